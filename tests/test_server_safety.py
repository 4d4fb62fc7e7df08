"""Bad input and vanishing clients: every one gets an error or a refusal, and the server keeps serving."""

import asyncio
import json
import logging
import threading
import urllib.request

import pytest

pytest.importorskip("aiortc")

import websockets  # noqa: E402
from openai_check import validate  # noqa: E402
from server_fakes import Client, FakeEngine, loopback_ice  # noqa: E402, F401
from websockets.exceptions import ConnectionClosed, InvalidStatus  # noqa: E402

from omni_rt.server import Server, ServerSettings  # noqa: E402
from omni_rt.server.peer import PeerSettings  # noqa: E402

SAY = {
    "type": "conversation.item.create",
    "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
}


def url(server: Server, query: str = "") -> str:
    return f"ws://127.0.0.1:{server.port}/ws{query}"


async def recv_json(ws, timeout: float = 5.0) -> dict:
    return validate(await asyncio.wait_for(ws.recv(), timeout))  # as the SDK's model has it


async def until(ws, type_: str, timeout: float = 5.0) -> list[dict]:
    events = []
    while not events or events[-1]["type"] != type_:
        events.append(await recv_json(ws, timeout))
    return events


async def assert_serves(server: Server) -> None:
    """A fresh client still gets a whole reply."""
    async with websockets.connect(url(server, f"?token={server.settings.token or ''}")) as ws:
        assert (await recv_json(ws))["type"] == "session.created"
        await ws.send(json.dumps(SAY))
        await ws.send(json.dumps({"type": "response.create"}))
        events = await until(ws, "response.done")
        assert events[-1]["response"]["status"] == "completed"


async def closed_with(ws) -> int:
    with pytest.raises(ConnectionClosed):
        while True:
            await asyncio.wait_for(ws.recv(), 5)
    return ws.close_code


async def test_token_is_enforced():
    async with Server(FakeEngine(step_s=0), ServerSettings(port=0, token="t0ken")) as server:
        for query in ("", "?token=", "?token=wrong"):
            with pytest.raises(InvalidStatus) as refused:
                await websockets.connect(url(server, query))
            assert refused.value.response.status_code == 401
        async with websockets.connect(url(server, "?token=t0ken")) as ws:
            assert (await recv_json(ws))["type"] == "session.created"
        async with websockets.connect(
            url(server), additional_headers={"Authorization": "Bearer t0ken"}
        ) as ws:
            assert (await recv_json(ws))["type"] == "session.created"
        await wait_for(lambda: not server.peers and server.engine.open_sessions == 0)


async def test_origin_is_same_origin_unless_allowed():
    settings = ServerSettings(port=0, allowed_origins=("https://app.example",))
    async with Server(FakeEngine(step_s=0), settings) as server:
        with pytest.raises(InvalidStatus) as refused:
            await websockets.connect(url(server), origin="http://evil.example")
        assert refused.value.response.status_code == 403
        with pytest.raises(InvalidStatus):
            await websockets.connect(url(server), origin=f"http://localhost:{server.port + 1}")
        # The page this server served (same host:port), an allowed origin, and clients with no Origin.
        for origin in (f"http://127.0.0.1:{server.port}", "https://app.example", None):
            async with websockets.connect(url(server), origin=origin) as ws:
                assert (await recv_json(ws))["type"] == "session.created"


@pytest.mark.parametrize(
    ("message", "code"),
    [
        ("{not json", "invalid_json"),
        ('["a list"]', "invalid_event"),
        pytest.param(
            '{"type": "response.create", "response": ' + "[" * 5000 + "]" * 5000 + "}",
            "invalid_json",
            id="deep-nesting",
        ),
    ],
)
async def test_a_message_that_is_not_an_event_fails_alone(message, code):
    """An error, and the connection and what was said in it stay: closing lost the conversation."""
    engine = FakeEngine(step_s=0)
    async with Server(engine, ServerSettings(port=0)) as server:
        async with websockets.connect(url(server)) as ws:
            await recv_json(ws)
            await ws.send(json.dumps(SAY))
            await until(ws, "conversation.item.done")
            await ws.send(message)
            event = await recv_json(ws)
            assert event["type"] == "error" and event["error"]["code"] == code
            await ws.send(json.dumps({"type": "response.create"}))
            assert (await until(ws, "response.done"))[-1]["response"]["status"] == "completed"
            assert engine.requests == ["hi"]  # what was said before the bad message is answered
        await wait_for(lambda: not server.peers and engine.open_sessions == 0)


@pytest.mark.parametrize(
    "message",
    [
        json.dumps({"type": "webrtc.offer", "sdp": "v=0\r\nthis is not sdp\r\n"}),
        json.dumps({"type": "webrtc.offer", "sdp": "garbage"}),
    ],
)
async def test_an_offer_that_cannot_be_answered_gets_an_error_and_a_clean_close(message):
    engine = FakeEngine(step_s=0)
    async with Server(engine, ServerSettings(port=0)) as server:
        async with websockets.connect(url(server)) as bystander:
            await recv_json(bystander)
            async with websockets.connect(url(server)) as ws:
                await recv_json(ws)
                await ws.send(message)
                event = await recv_json(ws)
                assert event["type"] == "error"
                assert event["error"]["code"] == "invalid_sdp"
                assert await closed_with(ws) == 1008
            # The other client and new clients are served as before.
            await bystander.send(json.dumps(SAY))
            await bystander.send(json.dumps({"type": "response.create"}))
            assert (await until(bystander, "response.done"))[-1]["response"]["status"] == "completed"
        await assert_serves(server)
        await wait_for(lambda: not server.peers and engine.open_sessions == 0)


async def test_malformed_json_on_the_data_channel():
    engine = FakeEngine(step_s=0)
    async with Server(engine, ServerSettings(port=0)) as server:
        async with websockets.connect(url(server)) as ws:
            client = Client(ws)
            await client.connect()
            client.send({"type": "response.cancel"})  # a mistake: answered on the channel, kept open
            assert (await client.until("error"))[-1]["error"]["code"] == "response_cancel_not_active"
            client.channel.send("{{{")  # not an event at all: answered the same way, kept open
            assert (await client.until("error"))[-1]["error"]["code"] == "invalid_json"
            client.say("hi")
            assert (await client.until("response.done"))[-1]["response"]["status"] == "completed"
            await client.close()
        await wait_for(lambda: not server.peers and engine.open_sessions == 0)
        await assert_serves(server)


async def test_text_that_is_not_utf8_on_the_data_channel_gets_an_error():
    # aiortc decodes data-channel text inside its SCTP loop: without the server's guard, invalid UTF-8
    # ended the association and the client heard nothing
    from aiortc.rtcsctptransport import WEBRTC_STRING

    engine = FakeEngine(step_s=0)
    async with Server(engine, ServerSettings(port=0)) as server:
        async with websockets.connect(url(server)) as ws:
            client = Client(ws)
            await client.connect()
            sctp = client.pc.sctp  # a client that sends raw bytes marked as text
            sctp._data_channel_queue.append((client.channel, WEBRTC_STRING, b'{"type": "\xff\xfe"}'))
            await sctp._data_channel_flush()
            assert (await client.until("error"))[-1]["error"]["code"] == "invalid_json"
            client.say("hi")  # the association and the connection stay
            assert (await client.until("response.done"))[-1]["response"]["status"] == "completed"
            await client.close()
        await wait_for(lambda: not server.peers and engine.open_sessions == 0)
        await assert_serves(server)


async def test_protocol_mistakes_get_an_error_and_keep_the_connection():
    async with Server(FakeEngine(step_s=0), ServerSettings(port=0)) as server:
        async with websockets.connect(url(server)) as ws:
            await recv_json(ws)
            mistakes = [
                ({"type": "no.such.event", "event_id": "e1"}, "unknown_event"),
                ({"type": "response.create", "response": {"metadata": {"k": "v" * 513}}}, "invalid_value"),
                ({"type": "response.cancel"}, "response_cancel_not_active"),
                ({"type": "conversation.item.create", "item": {"content": []}}, "invalid_value"),
                (
                    {
                        "type": "conversation.item.create",
                        "item": {"content": [{"type": "input_text", "text": ""}]},
                    },
                    "invalid_value",
                ),
                (
                    {"type": "session.update", "session": {"audio": {"output": {"voice": "nobody"}}}},
                    "invalid_value",
                ),
                ({"type": "session.update", "session": {"output_modalities": ["smell"]}}, "invalid_value"),
            ]
            for event, code in mistakes:
                await ws.send(json.dumps(event))
                reply = await recv_json(ws)
                assert reply["type"] == "error", event
                assert reply["error"]["code"] == code, (event, reply)
            assert (await recv_json_after_ping(ws)) is None
            # Still a working session, with the voice it had.
            await ws.send(json.dumps(SAY))
            await ws.send(json.dumps({"type": "response.create"}))
            assert (await until(ws, "response.done"))[-1]["response"]["status"] == "completed"


async def recv_json_after_ping(ws):
    """None if nothing more is pending on the socket (the errors came one per mistake)."""
    await ws.ping()
    try:
        return json.loads(await asyncio.wait_for(ws.recv(), 0.2))
    except TimeoutError:
        return None


async def test_session_limit():
    async with Server(FakeEngine(step_s=0), ServerSettings(port=0, max_sessions=2)) as server:
        async with websockets.connect(url(server)) as a, websockets.connect(url(server)) as b:
            await recv_json(a)
            await recv_json(b)
            async with websockets.connect(url(server)) as c:
                event = await recv_json(c)
                assert event["type"] == "error" and event["error"]["code"] == "session_limit"
                assert await closed_with(c) == 1013
        await assert_serves(server)


async def test_a_slot_lost_while_the_session_restarts_closes_as_the_limit_does():
    """session.update with new instructions reopens the Session; if the slot it gave back is taken
    meanwhile, the client gets session_limit and close code 1013 (try again later), as at connect; it
    was 1008 (policy violation), which says the client broke a rule."""
    engine = FakeEngine(step_s=0, max_sessions=1)
    async with Server(engine, ServerSettings(port=0)) as server:
        async with websockets.connect(url(server)) as ws:
            await recv_json(ws)
            engine.max_sessions = 0  # another client's transcription takes the slot as it comes free
            await ws.send(json.dumps({"type": "session.update", "session": {"instructions": "New."}}))
            event = await recv_json(ws)
            assert event["type"] == "error" and event["error"]["code"] == "session_limit", event
            assert await closed_with(ws) == 1013
        engine.max_sessions = 1
        await assert_serves(server)


async def test_the_engines_own_session_limit_has_the_same_code_and_close():
    # the engine full before the server is (e.g. another connection's transcription took a slot):
    # the engine's SessionLimitError reaches the client as the server's own limit does
    async with Server(FakeEngine(step_s=0, max_sessions=1), ServerSettings(port=0, max_sessions=4)) as server:
        async with websockets.connect(url(server)) as a:
            assert (await recv_json(a))["type"] == "session.created"
            async with websockets.connect(url(server)) as b:
                event = await recv_json(b)
                assert event["type"] == "error" and event["error"]["code"] == "session_limit", event
                assert await closed_with(b) == 1013
        await assert_serves(server)


async def test_static_files_and_no_traversal():
    async with Server(FakeEngine(step_s=0), ServerSettings(port=0)) as server:
        base = f"http://127.0.0.1:{server.port}"

        def get(path):
            try:
                with urllib.request.urlopen(base + path, timeout=5) as r:
                    return r.status, r.headers.get("Content-Type"), r.read()
            except urllib.error.HTTPError as exc:
                return exc.code, None, b""

        status, kind, body = await asyncio.to_thread(get, "/")
        assert status == 200 and kind.startswith("text/html") and b"app.js" in body
        status, kind, _ = await asyncio.to_thread(get, "/app.js")
        assert status == 200 and "javascript" in kind
        for path in ("/../pyproject.toml", "/%2e%2e/pyproject.toml", "/nope.js", "/.hidden"):
            assert (await asyncio.to_thread(get, path))[0] == 404, path
        assert (await asyncio.to_thread(get, "/ws"))[0] == 426  # the socket endpoint wants an upgrade


async def test_vanished_peer_mid_response_frees_its_session_and_work():
    engine = FakeEngine(step_s=0.02, frames_per_word=2, reply=" ".join(["word"] * 500))
    async with Server(engine, ServerSettings(port=0)) as server:
        ws = await websockets.connect(url(server))
        client = Client(ws)
        await client.connect()
        client.say("a long story")
        await client.until("output_audio_buffer.started")
        assert engine.running == 1
        # Gone without a goodbye: no cancel, no close handshake on the socket.
        await client.pc.close()
        ws.transport.abort()
        await wait_for(lambda: engine.running == 0 and engine.open_sessions == 0 and not server.peers)
        steps = engine.steps
        await asyncio.sleep(0.2)
        assert engine.steps == steps  # no more model work for the vanished client
        await client.close()


async def test_connect_disconnect_cycles_leave_nothing_behind():
    engine = FakeEngine(step_s=0.01, frames_per_word=2, reply=" ".join(["word"] * 200))
    async with Server(engine, ServerSettings(port=0, peer=PeerSettings())) as server:

        async def cycle(mid_response: bool) -> None:
            async with websockets.connect(url(server)) as ws:
                client = Client(ws)
                await client.connect()
                if mid_response:
                    client.say("talk")
                    await client.until("response.output_audio_transcript.delta")
                await client.close()

        await cycle(True)  # warm up: the default executor's encoder threads, imports, caches
        await wait_for(lambda: not server.peers)
        await asyncio.sleep(0.2)
        tasks_before = len(asyncio.all_tasks())
        threads_before = threading.active_count()

        for i in range(50):
            await cycle(mid_response=i % 2 == 0)

        await wait_for(lambda: not server.peers and engine.open_sessions == 0 and engine.running == 0, 10)
        await wait_for(lambda: len(asyncio.all_tasks()) <= tasks_before, 10)
        assert len(engine.sessions) == 51
        assert threading.active_count() <= threads_before + 2, [t.name for t in threading.enumerate()]


async def test_server_close_with_a_reply_in_progress():
    engine = FakeEngine(step_s=0.02, reply=" ".join(["word"] * 500))
    server = Server(engine, ServerSettings(port=0))
    await server.start()
    ws = await websockets.connect(url(server))
    client = Client(ws)
    await client.connect()
    client.say("go")
    await client.until("output_audio_buffer.started")
    await asyncio.wait_for(server.close(), 10)
    assert not server.peers and engine.open_sessions == 0 and engine.running == 0
    await client.close()


@pytest.fixture(scope="module")
def tiny():
    import omni_rt

    return omni_rt.Engine.load("tiny")


async def test_vanished_and_cycling_peers_stop_the_real_pipeline(tiny):
    settings = ServerSettings(port=0, peer=PeerSettings(max_audio_frames=2000))
    async with tiny, Server(tiny, settings) as server:
        pipeline = tiny.pipeline
        ws = await websockets.connect(url(server))
        client = Client(ws)
        await client.connect()
        client.say("tell me a long story")
        await client.until("output_audio_buffer.started", timeout=30)
        await client.pc.close()
        ws.transport.abort()  # gone mid-reply, without a word
        await wait_for(lambda: not server.peers, 10)
        await asyncio.sleep(0.2)
        steps = len(pipeline.steps)
        await asyncio.sleep(0.5)
        assert len(pipeline.steps) == steps  # the model stopped working for it
        await client.close()

        threads = threading.active_count()
        for i in range(10):
            async with websockets.connect(url(server)) as ws:
                client = Client(ws)
                await client.connect()
                if i % 2 == 0:
                    client.say("talk")
                    await client.until("output_audio_buffer.started", timeout=30)
                await client.close()
        await wait_for(lambda: not server.peers, 10)
        assert threading.active_count() <= threads + 2
        # Every engine slot is free again: it admits as many sessions as it has.
        sessions = [tiny.session() for _ in range(tiny.settings.max_sessions)]
        for session in sessions:
            await session.close()


async def wait_for(condition, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.02)


async def test_serve_command_starts_prints_its_url_and_stops_on_ctrl_c():
    import re
    import signal
    import sys

    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "omni_rt.server.app", "--port", "0", "--token", "tk",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    try:
        url = None
        async with asyncio.timeout(60):
            while url is None:
                line = (await proc.stdout.readline()).decode()
                assert line, "the server exited before printing its URL"
                if match := re.search(r"serving tiny at (http://127\.0\.0\.1:(\d+)/\?token=tk)", line):
                    url, port = match.group(1), int(match.group(2))

        def get(path):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
                return r.status, r.read()

        status, body = await asyncio.to_thread(get, "/health")
        assert status == 200 and json.loads(body)["ok"] is True
        engine = json.loads(body)["engine"]  # the engine's capacity: sessions, ceiling, cache bytes
        assert engine["sessions"] == 0 and engine["max_sessions"] >= 1 and engine["kv_bytes_per_slot"] > 0
        async with websockets.connect(f"ws://127.0.0.1:{port}/ws?token=tk") as ws:
            assert (await recv_json(ws, 10))["type"] == "session.created"
        proc.send_signal(signal.SIGINT)
        async with asyncio.timeout(30):
            rest = (await proc.stdout.read()).decode()
            assert await proc.wait() == 0
        assert "stopped" in rest and "Traceback" not in rest
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def test_serve_arguments_are_checked():
    from omni_rt.server.app import parse_args

    args = parse_args([])
    assert (args.model, args.host, args.port, args.token, args.max_sessions) == (
        "tiny",
        "127.0.0.1",
        8080,
        None,
        4,
    )
    # a short demo reply from the babbling tiny preset; a checkpoint gets a minute
    assert args.max_audio_seconds == 8.0 and parse_args(["--model", "/ckpt"]).max_audio_seconds == 60.0
    assert parse_args(["--max-audio-seconds", "30"]).max_audio_seconds == 30.0
    for bad in (
        ["--max-sessions", "0"],
        ["--port", "70000"],
        ["--idle", "beep"],
        ["--max-audio-seconds", "0"],
        ["--allow-origin", "app.example"],  # no scheme: it would never match a browser's Origin
    ):
        with pytest.raises(SystemExit):
            parse_args(bad)


async def test_without_the_page_the_socket_still_serves(monkeypatch):
    from omni_rt.server import app

    monkeypatch.setattr(app, "find_web_dir", lambda: None)
    async with Server(FakeEngine(step_s=0), ServerSettings(port=0)) as server:
        with pytest.raises(urllib.error.HTTPError) as missing:
            await asyncio.to_thread(urllib.request.urlopen, f"http://127.0.0.1:{server.port}/", timeout=5)
        assert missing.value.code == 404
        missing.value.close()  # an unread error response would hold its connection open
        await assert_serves(server)


async def test_user_input_waiting_for_a_response_is_bounded():
    # A client that adds messages and never asks for a response must not grow the server's memory.
    settings = ServerSettings(port=0, peer=PeerSettings(max_pending_text_chars=100))
    engine = FakeEngine(step_s=0)
    async with Server(engine, settings) as server:
        async with websockets.connect(url(server)) as ws:
            await recv_json(ws)
            say = {**SAY, "item": {**SAY["item"], "content": [{"type": "input_text", "text": "x" * 60}]}}
            await ws.send(json.dumps(say))
            assert [(await recv_json(ws))["type"] for _ in range(2)] == [
                "conversation.item.added",
                "conversation.item.done",
            ]
            for _ in range(3):
                await ws.send(json.dumps({**say, "event_id": "e2"}))
                error = (await recv_json(ws))["error"]
                assert (error["code"], error["event_id"]) == ("pending_input_full", "e2")
            await ws.send(json.dumps({"type": "response.create"}))
            assert (await until(ws, "response.done"))[-1]["response"]["status"] == "completed"
            assert engine.requests == ["x" * 60]  # what was accepted, once
            await ws.send(json.dumps(say))  # answered input makes room again
            assert (await recv_json(ws))["type"] == "conversation.item.added"


async def test_token_with_reserved_characters_survives_the_printed_url():
    token = "a+b&c d/é"
    async with Server(FakeEngine(step_s=0), ServerSettings(port=0, token=token)) as server:
        from urllib.parse import parse_qs, quote, urlsplit

        assert parse_qs(urlsplit(server.url).query) == {"token": [token]}  # what the page reads
        async with websockets.connect(url(server, f"?token={quote(token, safe='')}")) as ws:
            assert (await recv_json(ws))["type"] == "session.created"


async def test_bearer_scheme_is_case_insensitive():
    async with Server(FakeEngine(step_s=0), ServerSettings(port=0, token="t0ken")) as server:
        for scheme in ("bearer", "BEARER"):
            headers = {"Authorization": f"{scheme} t0ken"}
            async with websockets.connect(url(server), additional_headers=headers) as ws:
                assert (await recv_json(ws))["type"] == "session.created"


async def test_allowed_origins_match_as_browsers_write_them():
    # Browsers send the origin lower-case, without a path or a default port; a flag may not be so tidy.
    settings = ServerSettings(port=0, allowed_origins=("https://App.Example/", "http://dev.example:80"))
    async with Server(FakeEngine(step_s=0), settings) as server:
        for origin in ("https://app.example", "http://dev.example"):
            async with websockets.connect(url(server), origin=origin) as ws:
                assert (await recv_json(ws))["type"] == "session.created"
        for origin in ("https://app.example.evil", "http://app.example", "https://dev.example"):
            with pytest.raises(InvalidStatus) as refused:
                await websockets.connect(url(server), origin=origin)
            assert refused.value.response.status_code == 403


async def handshake_status(server: Server, headers: list[tuple[str, str]]) -> int:
    """The HTTP status of a WebSocket handshake to /ws with exactly these headers (Host included)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    lines = ["GET /ws HTTP/1.1", "Upgrade: websocket", "Connection: Upgrade", "Sec-WebSocket-Version: 13"]
    lines += ["Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ=="] + [f"{k}: {v}" for k, v in headers]
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
    status = int((await asyncio.wait_for(reader.readline(), 5)).split()[1])
    writer.close()
    return status


async def test_a_rebound_host_name_is_not_the_same_origin():
    # DNS rebinding: a page of http://evil.example:PORT whose name now points at 127.0.0.1 calls
    # ws://evil.example:PORT/ws. Origin and Host agree, yet it is not this server's page: a server
    # on loopback takes the same-origin path only for loopback names.
    async with Server(FakeEngine(step_s=0), ServerSettings(port=0)) as server:
        port = server.port
        rebound = f"evil.example:{port}"
        assert await handshake_status(server, [("Host", rebound), ("Origin", f"http://{rebound}")]) == 403
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}"):
            assert await handshake_status(server, [("Host", host), ("Origin", f"http://{host}")]) == 101
        assert await handshake_status(server, [("Host", rebound)]) == 101  # no Origin: not a browser


async def test_repeated_security_headers_are_refused_not_a_server_error():
    async with Server(FakeEngine(step_s=0), ServerSettings(port=0, token="t")) as server:
        host = ("Host", f"127.0.0.1:{server.port}")
        origin = ("Origin", f"http://{host[1]}")
        auth = ("Authorization", "Bearer t")
        assert await handshake_status(server, [host, origin, auth]) == 101
        for twice in (host, origin, auth):
            assert await handshake_status(server, [host, origin, auth, twice]) == 400, twice


async def test_a_client_that_stops_reading_is_dropped_promptly(caplog):
    # Audio as events piles up in front of a client that reads nothing: past the outbox it is
    # dropped, its work stops, and its slot is free within seconds (the close handshake cannot
    # complete through a full TCP window, so it is not waited for). Said in one log line, not one per
    # event that no longer fits (issue #13, defect 8: 52 lines in 5 ms).
    caplog.set_level(logging.WARNING, logger="omni_rt.server")
    engine = FakeEngine(step_s=0.0, frames_per_word=25, reply=" ".join(["w"] * 3000))
    async with Server(engine, ServerSettings(port=0)) as server:
        ws = await websockets.connect(url(server), max_queue=1, ping_interval=None)
        await ws.send(json.dumps(SAY))
        await ws.send(json.dumps({"type": "response.create"}))
        await wait_for(lambda: engine.running == 1)
        await wait_for(lambda: not server.peers and engine.running == 0 and engine.open_sessions == 0, 8)
        ws.transport.abort()
        drops = [r for r in caplog.records if "not drained" in r.getMessage()]
        assert len(drops) == 1, [r.getMessage() for r in caplog.records]
        engine.reply, engine.frames_per_word = None, 1
        await assert_serves(server)


async def test_server_close_does_not_wait_for_a_client_that_stopped_reading():
    engine = FakeEngine(step_s=0.0, frames_per_word=25, reply=" ".join(["w"] * 100))
    server = Server(engine, ServerSettings(port=0))
    await server.start()
    ws = await websockets.connect(url(server), max_queue=1, ping_interval=None)
    await ws.send(json.dumps(SAY))
    await ws.send(json.dumps({"type": "response.create"}))
    await wait_for(lambda: engine.steps == 100)  # all of it made; most of it stuck in front of the client
    await asyncio.wait_for(server.close(), 4)  # Ctrl-C on `omni-rt serve`
    assert not server.peers and engine.open_sessions == 0
    ws.transport.abort()


async def test_the_socket_reads_ahead_of_the_peer_by_bytes_too():
    """A message may be 2 MiB (a whole clip's append): the inbox's 64 messages could hold 128 MiB (and
    8 MiB frames, 512) of a client flooding them. The socket is read ahead by 8 MiB at most."""
    from omni_rt.server.transport import INBOX_BYTES, Transport

    message = "x" * 2_000_000

    class Socket:  # a client that sends ten such messages at once
        async def __aiter__(self):
            for _ in range(10):
                yield message

    inbox: asyncio.Queue = asyncio.Queue(64)
    transport = Transport(Socket(), "t", inbox, lambda: None)
    reader = asyncio.create_task(transport.read_socket())
    for _ in range(20):
        await asyncio.sleep(0)
    assert inbox.qsize() == INBOX_BYTES // len(message) + 1  # the one that went past, then it waits
    raw, source = inbox.get_nowait()
    transport.taken(raw, source)
    for _ in range(20):
        await asyncio.sleep(0)
    assert inbox.qsize() == INBOX_BYTES // len(message) + 1
    reader.cancel()
