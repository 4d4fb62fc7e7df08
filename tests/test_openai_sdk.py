"""The official `openai` SDK, unmodified, against `omni-rt serve` on the tiny preset (real pipeline).

`client.realtime.connect()` opens `<websocket_base_url>/realtime?model=M` with the API key as a Bearer
token; every event the server sends is validated against the SDK's own models (`openai_check`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import time

import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("aiortc")

from openai_check import validate  # noqa: E402
from server_fakes import candidate_addresses, loopback_ice, speech_like  # noqa: E402, F401

from omni_rt.server import PeerSettings, Server, ServerSettings  # noqa: E402

TOKEN = "sk-local-test"


@pytest.fixture(scope="module")
def tiny():
    import omni_rt

    return omni_rt.Engine.load("tiny")


@pytest.fixture
async def served(tiny):
    # A few tokens and frames a reply: the test checks the flow, not the babble of random weights.
    peer = PeerSettings(model="tiny", max_output_tokens=6, max_audio_frames=6)
    async with tiny, Server(tiny, ServerSettings(port=0, token=TOKEN, peer=peer)) as server:
        client = openai.AsyncOpenAI(
            api_key=TOKEN,
            base_url=f"http://127.0.0.1:{server.port}/v1",
            websocket_base_url=f"ws://127.0.0.1:{server.port}/v1",
        )
        yield server, client


async def recv(conn) -> dict:
    return validate(await asyncio.wait_for(conn.recv_bytes(), 60))


async def until(conn, type_: str) -> list[dict]:
    events = []
    while not events or events[-1]["type"] != type_:
        events.append(await recv(conn))
    return events


def check_reply(events: list[dict], *, audio: bool) -> dict:
    """The GA order of one reply, with one item and one part, the same ids throughout."""
    types = [e["type"] for e in events]
    start = types.index("response.created")
    rid = events[start]["response"]["id"]
    # The input's transcription runs beside the reply (OpenAI's does too): its events are not the reply's.
    reply = [
        e
        for e in events[start:]
        if (e.get("response_id", rid) == rid or "item" in e) and "input_audio_transcription" not in e["type"]
    ]
    kinds = [e["type"] for e in reply]
    delta = "response.output_audio_transcript.delta" if audio else "response.output_text.delta"
    opened = ["response.output_item.added", "conversation.item.added", "response.content_part.added"]
    closed = ["response.content_part.done", "response.output_item.done", "conversation.item.done"]
    first_delta = min(kinds.index(k) for k in (delta, "response.output_audio.delta") if k in kinds)
    assert [k for k in kinds[:first_delta] if k in opened] == opened
    assert kinds[first_delta - 3 : first_delta] == opened
    tail = [k for k in kinds if k in closed or k == "response.done"]
    assert tail == [*closed, "response.done"]
    item = reply[kinds.index("response.output_item.added")]["item"]
    assert item["role"] == "assistant" and item["status"] == "in_progress"
    assert all(e["item_id"] == item["id"] for e in reply if "item_id" in e)
    done = reply[-1]["response"]
    assert done["output"][0]["id"] == item["id"]
    assert done["output"][0]["status"] == ("completed" if done["status"] == "completed" else "incomplete")
    return done


async def test_text_and_audio_turns_validate_against_the_sdk(served):
    server, client = served
    async with client.realtime.connect(model="tiny") as conn:
        created = await recv(conn)
        assert created["type"] == "session.created"
        # OpenAI names, as SDK users send them: an OpenAI voice maps to a model voice (the table).
        await conn.session.update(
            session={
                "type": "realtime",
                "output_modalities": ["text"],
                "audio": {"output": {"voice": "alloy"}},
                "instructions": "Be brief.",
            }
        )
        updated = await recv(conn)
        assert updated["type"] == "session.updated"
        assert updated["session"]["audio"]["output"]["voice"] == "chelsie"

        await conn.conversation.item.create(
            item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello!"}]}
        )
        user = await until(conn, "conversation.item.done")
        await conn.response.create(response={"metadata": {"turn": "one"}})
        events = await until(conn, "response.done")
        done = check_reply(events, audio=False)
        assert events[0]["response"]["metadata"] == {"turn": "one"}
        assert done["metadata"] == {"turn": "one"} and done["status"] in ("completed", "incomplete")
        assert done["output"][0]["content"][0]["type"] == "output_text"
        added = next(e for e in events if e["type"] == "conversation.item.added")
        assert added["previous_item_id"] == user[-1]["item"]["id"] and added["item"]["role"] == "assistant"

        # Audio, with no new input: the model answers the conversation as it stands.
        await conn.response.create(response={"output_modalities": ["audio"]})
        events = await until(conn, "response.done")
        done = check_reply(events, audio=True)
        pcm = b"".join(
            base64.b64decode(e["delta"]) for e in events if e["type"] == "response.output_audio.delta"
        )
        assert len(pcm) > 0 and done["output"][0]["content"][0]["type"] == "output_audio"


async def test_cancel_and_a_turn_after_it(served):
    server, client = served
    async with client.realtime.connect(model="tiny") as conn:
        await recv(conn)
        await conn.session.update(session={"type": "realtime", "output_modalities": ["audio"]})
        await recv(conn)
        await conn.conversation.item.create(
            item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Talk."}]}
        )
        await until(conn, "conversation.item.done")
        await conn.response.create(response={"max_output_tokens": 64})
        await until(conn, "response.created")
        await conn.response.cancel()
        await conn.response.cancel()  # the second finds nothing active (issue #13, defect 8)
        events = await until(conn, "response.done")
        done = events[-1]["response"]
        if not any(e["type"] == "error" for e in events):  # the first cancel may finish first
            events += await until(conn, "error")
        errors = [e for e in events if e["type"] == "error"]
        assert [e["error"]["code"] for e in errors] == ["response_cancel_not_active"]
        assert done["status"] == "cancelled"
        assert done["status_details"] == {"type": "cancelled", "reason": "client_cancelled"}
        assert all(item["status"] == "incomplete" for item in done["output"])

        await conn.conversation.item.create(
            item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Again."}]}
        )
        await conn.response.create()
        events = await until(conn, "response.done")
        assert check_reply(events, audio=True)["status"] in ("completed", "incomplete")


async def test_a_session_update_during_the_first_reply_is_the_next_replys(served):
    # The Session commits a turn when its reply ends, so during the first reply nothing is said yet: an
    # update of the instructions then opened a fresh Session (ending the reply) had it not been refused.
    # OpenAI's server takes it; it must change nothing running.
    server, client = served
    async with client.realtime.connect(model="tiny") as conn:
        await recv(conn)
        await conn.conversation.item.create(
            item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Talk."}]}
        )
        await until(conn, "conversation.item.done")
        await conn.response.create()
        events = await until(conn, "response.created")
        await conn.session.update(
            session={"type": "realtime", "instructions": "Be brief.", "audio": {"output": {"voice": "alloy"}}}
        )
        events += await until(conn, "response.done")
        if not any(e["type"] == "session.updated" for e in events):
            events += await until(conn, "session.updated")
        assert not [e for e in events if e["type"] == "error"]
        assert check_reply(events, audio=True)["status"] in ("completed", "incomplete")
        updated = next(e for e in events if e["type"] == "session.updated")
        assert updated["session"]["instructions"] == "Be brief."
        await conn.response.create()  # the conversation goes on, in the new voice
        events = await until(conn, "response.done")
        assert check_reply(events, audio=True)["status"] in ("completed", "incomplete")


async def test_a_spoken_turn_with_server_vad(served):
    server, client = served
    async with client.realtime.connect(model="tiny") as conn:
        await recv(conn)
        speech = np.concatenate([np.zeros(4800), speech_like(1.0, 24000), np.zeros(24000)])
        pcm = (np.clip(speech, -1, 1) * 32767).astype("<i2").tobytes()
        for start in range(0, len(pcm), 9600):  # 200 ms per append, as SDK users send it
            await conn.input_audio_buffer.append(audio=base64.b64encode(pcm[start : start + 9600]).decode())
        events = await until(conn, "response.done")
        types = [e["type"] for e in events]
        assert types.index("input_audio_buffer.speech_started") < types.index("input_audio_buffer.committed")
        assert types.index("input_audio_buffer.committed") < types.index("response.created")
        check_reply(events, audio=True)


async def test_a_whole_recorded_clip_in_one_append(served):
    """OpenAI takes up to 15 MiB in one append, and its guide sends a whole recorded file so: a clip of
    a few seconds (over 256 KiB as base64) closed the connection (1009), and over 2 s was refused."""
    server, client = served
    async with client.realtime.connect(model="tiny") as conn:
        await recv(conn)
        speech = np.concatenate([np.zeros(4800), speech_like(4.0, 24000), np.zeros(24000)])
        pcm = (np.clip(speech, -1, 1) * 32767).astype("<i2").tobytes()
        assert len(pcm) * 4 // 3 > 256 * 1024
        await conn.input_audio_buffer.append(audio=base64.b64encode(pcm).decode())
        events = await until(conn, "response.done")
        types = [e["type"] for e in events]
        assert types.index("input_audio_buffer.speech_started") < types.index("input_audio_buffer.committed")
        check_reply(events, audio=True)


async def test_a_committed_turn_with_input_transcription(served):
    """Manual turns (turn_detection null) and input transcription, as SDK users switch them on: the
    `.completed` event once lacked its required `usage`, which the SDK's model rejects."""
    server, client = served
    async with client.realtime.connect(model="tiny") as conn:
        await recv(conn)
        audio_input = {"turn_detection": None, "transcription": {"model": "gpt-4o-transcribe"}}
        await conn.session.update(session={"type": "realtime", "audio": {"input": audio_input}})
        updated = (await recv(conn))["session"]["audio"]["input"]
        assert updated["turn_detection"] is None and updated["transcription"] == audio_input["transcription"]
        pcm = (np.clip(speech_like(0.6, 24000), -1, 1) * 32767).astype("<i2").tobytes()
        await conn.input_audio_buffer.append(audio=base64.b64encode(pcm).decode())
        await conn.input_audio_buffer.commit()
        committed = await until(conn, "conversation.item.done")
        item_id = committed[0]["item_id"]
        assert [e["type"] for e in committed] == [
            "input_audio_buffer.committed", "conversation.item.added", "conversation.item.done",
        ]  # fmt: skip
        await conn.response.create()
        events = await until(conn, "response.done")
        check_reply(events, audio=True)
        if not any(e["type"].endswith("transcription.completed") for e in events):
            events += await until(conn, "conversation.item.input_audio_transcription.completed")
        completed = next(e for e in events if e["type"].endswith("transcription.completed"))
        assert completed["item_id"] == item_id
        assert completed["usage"] == {"type": "duration", "seconds": pytest.approx(0.6, abs=0.01)}


async def test_a_hostile_connection_leaves_a_healthy_reply_whole(served):
    """While an SDK client's reply runs on the real pipeline, another connection sends every kind of
    mistake, a flood of appends and finally something that is not an event: it gets errors (each its
    own, event ids echoed); the reply is whole, and the server takes a new client."""
    import websockets

    server, client = served
    async with client.realtime.connect(model="tiny") as good:
        await recv(good)
        async with websockets.connect(
            f"{client.websocket_base_url}/realtime?model=tiny",
            additional_headers={"Authorization": f"Bearer {TOKEN}"},
        ) as bad:
            await bad.recv()
            await good.conversation.item.create(
                item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi."}]}
            )
            await good.response.create()
            reply = await until(good, "response.created")
            mistakes = [
                {"type": "session.update", "session": {"tools": "x"}},
                {"type": "conversation.item.create", "item": 5},
                {"type": "response.create", "response": {"max_output_tokens": "lots"}},
                {"type": "conversation.item.truncate", "item_id": 5, "audio_end_ms": "x"},
                {"type": "input_audio_buffer.append", "audio": "not base64"},
                {"type": "x" * 100_000},
                {"type": "session.update", "session": {"instructions": "x" * 200_000}},
            ]
            for i, event in enumerate(mistakes):
                await bad.send(json.dumps({**event, "event_id": f"m{i}"}))
            two_seconds = base64.b64encode(bytes(96_000)).decode()
            for _ in range(40):  # 80 s of audio at once: past the 30 s burst it is refused
                await bad.send(json.dumps({"type": "input_audio_buffer.append", "audio": two_seconds}))
            await bad.send("[]")  # not an event: fails alone too
            errors = []
            while not errors or errors[-1]["code"] != "invalid_event":
                errors.append(validate(json.loads(await asyncio.wait_for(bad.recv(), 30)))["error"])
            assert [e["event_id"] for e in errors[: len(mistakes)]] == [f"m{i}" for i in range(len(mistakes))]
            assert {e["code"] for e in errors[len(mistakes) : -1]} == {"rate_limited"}
        check_reply(reply + await until(good, "response.done"), audio=True)
    async with client.realtime.connect(model="tiny") as again:
        assert (await recv(again))["type"] == "session.created"


# -- ephemeral keys and WebRTC calls, the OpenAI way --------------------------------------------------------


async def test_client_secret_then_a_webrtc_call_and_hangup(served):
    from aiortc import RTCPeerConnection, RTCSessionDescription
    from openai.types.realtime import ClientSecretCreateResponse

    server, client = served
    secret = await client.realtime.client_secrets.with_raw_response.create(
        expires_after={"anchor": "created_at", "seconds": 60},
        session={"type": "realtime", "instructions": "Greet.", "audio": {"output": {"voice": "marin"}}},
    )
    body = ClientSecretCreateResponse.model_validate(json.loads(secret.text))  # the SDK's own model
    assert body.value.startswith("ek_") and time.time() < body.expires_at <= time.time() + 61
    assert body.session.audio.output.voice == "chelsie"  # marin, by the voice table

    # The page's side: the key is its Bearer; the server's token never reaches it.
    page = openai.AsyncOpenAI(api_key=body.value, base_url=client.base_url)
    pc = RTCPeerConnection()
    pc.addTransceiver("audio", direction="recvonly")
    channel = pc.createDataChannel("oai-events")
    events: asyncio.Queue = asyncio.Queue()
    channel.on("message", lambda m: events.put_nowait(validate(m)))
    heard: list = []

    @pc.on("track")
    def _track(track):
        async def read():
            with contextlib.suppress(Exception):
                while True:
                    heard.append(await track.recv())

        asyncio.ensure_future(read())

    await pc.setLocalDescription(await pc.createOffer())
    raw = await page.realtime.calls.with_raw_response.create(
        sdp=pc.localDescription.sdp, session={"type": "realtime", "output_modalities": ["audio"]}
    )
    assert raw.status_code == 201 and raw.headers["content-type"].startswith("application/sdp")
    call_id = raw.headers["location"].rsplit("/", 1)[1]
    assert raw.headers["location"] == f"/v1/realtime/calls/{call_id}"
    assert set(candidate_addresses(raw.text)) == {"127.0.0.1"}
    await pc.setRemoteDescription(RTCSessionDescription(sdp=raw.text, type="answer"))

    async def next_event(type_: str) -> list[dict]:
        seen = []
        while not seen or seen[-1]["type"] != type_:
            seen.append(await asyncio.wait_for(events.get(), 60))
        return seen

    created = (await next_event("session.created"))[-1]["session"]
    assert created["instructions"] == "Greet." and created["audio"]["output"]["voice"] == "chelsie"
    channel.send(json.dumps({"type": "response.create"}))  # a greeting: no user input
    reply = await next_event("response.done")
    check_reply(reply, audio=True)
    await next_event("output_audio_buffer.stopped")
    loud = [f for f in heard if np.abs(f.to_ndarray()).max() > 100]
    assert loud, "no audio heard on the track"

    await client.realtime.calls.hangup(call_id)
    async with asyncio.timeout(10):
        while server.peers:
            await asyncio.sleep(0.05)
    with pytest.raises(openai.NotFoundError):
        await client.realtime.calls.hangup(call_id)
    await pc.close()


async def test_keys_that_are_expired_or_unknown_are_refused(served):
    server, client = served
    secret = await client.realtime.client_secrets.create()
    server.rest.keys[secret.value] = dataclasses.replace(
        server.rest.keys[secret.value], expires_at=int(time.time()) - 1
    )
    for key in (secret.value, "ek_unknown", "sk-wrong"):
        other = openai.AsyncOpenAI(
            api_key=key, base_url=client.base_url, websocket_base_url=client.websocket_base_url
        )
        with pytest.raises(openai.AuthenticationError):
            await other.realtime.calls.create(sdp="v=0\r\n")
        with pytest.raises(Exception, match="401"):
            async with other.realtime.connect(model="tiny") as conn:
                await conn.recv()
        # A key never mints keys.
        with pytest.raises(openai.AuthenticationError):
            await other.realtime.client_secrets.create()
    fresh = await client.realtime.client_secrets.create()
    with pytest.raises(openai.AuthenticationError):
        await openai.AsyncOpenAI(
            api_key=fresh.value, base_url=client.base_url
        ).realtime.client_secrets.create()
    # A live key opens the WebSocket too.
    live = openai.AsyncOpenAI(
        api_key=fresh.value, base_url=client.base_url, websocket_base_url=client.websocket_base_url
    )
    async with live.realtime.connect(model="tiny") as conn:
        assert (await recv(conn))["type"] == "session.created"


async def test_a_socket_for_what_the_server_does_not_serve_is_refused_at_the_handshake(served):
    """`connect(call_id=...)` (joining a WebRTC call) and `intent=transcription` once opened an
    unrelated realtime session, which the client took for the call or a transcription session."""
    server, client = served
    for kwargs in ({"call_id": "rtc_123"}, {"model": "tiny", "extra_query": {"intent": "transcription"}}):
        with pytest.raises(Exception, match="400"):
            async with client.realtime.connect(**kwargs) as conn:
                await conn.recv()
    assert not server.peers
