"""`/v1/realtime/calls` and `/v1/realtime/client_secrets` over plain HTTP: what a client gets wrong."""

import asyncio
import json

import httpx
import pytest

pytest.importorskip("aiortc")

from aiortc import RTCPeerConnection, RTCSessionDescription  # noqa: E402
from server_fakes import FakeEngine, candidate_addresses, loopback_ice  # noqa: E402, F401

from omni_rt.server import Server, ServerSettings  # noqa: E402
from omni_rt.server.http import MAX_BODY_BYTES  # noqa: E402


async def test_a_raw_sdp_call_gets_its_events_and_ends_at_hangup():
    engine = FakeEngine(step_s=0.0, reply="hello there")
    async with Server(engine, ServerSettings(port=0, token="tk")) as server:
        auth = {"Authorization": "Bearer tk"}
        async with httpx.AsyncClient() as http:
            pc, channel, events, r = await call(http, server)
            assert set(candidate_addresses(r.text)) == {"127.0.0.1"}
            assert (await asyncio.wait_for(events.get(), 10))["type"] == "session.created"
            channel.send(json.dumps({"type": "response.create"}))
            while (ev := await asyncio.wait_for(events.get(), 10))["type"] != "response.done":
                pass
            assert ev["response"]["status"] == "completed"
            assert len(server.peers) == 1 and engine.open_sessions == 1

            r = await http.post(f"{server_url(server)}{r.headers['location']}/hangup", headers=auth)
            assert r.status_code == 200
            async with asyncio.timeout(10):
                while server.peers or engine.open_sessions:
                    await asyncio.sleep(0.02)
        await pc.close()


def server_url(server: Server) -> str:
    return f"http://127.0.0.1:{server.port}"


async def call(http: httpx.AsyncClient, server: Server):
    """A raw-SDP call with an `oai-events` channel, answered: (pc, channel, events queue, the answer)."""
    events: asyncio.Queue = asyncio.Queue()
    pc = RTCPeerConnection()
    pc.addTransceiver("audio", direction="recvonly")
    channel = pc.createDataChannel("oai-events")
    channel.on("message", lambda m: events.put_nowait(json.loads(m)))
    await pc.setLocalDescription(await pc.createOffer())
    r = await http.post(
        f"{server_url(server)}/v1/realtime/calls",
        content=pc.localDescription.sdp,
        headers={"Authorization": "Bearer tk", "Content-Type": "application/sdp"},
    )
    assert r.status_code == 201, r.text
    await pc.setRemoteDescription(RTCSessionDescription(sdp=r.text, type="answer"))
    return pc, channel, events, r


async def test_call_and_key_mistakes_get_clear_http_errors():
    engine = FakeEngine(step_s=0.0)
    async with Server(engine, ServerSettings(port=0, token="tk", max_sessions=1)) as server:
        base = f"{server_url(server)}/v1/realtime"
        auth = {"Authorization": "Bearer tk"}
        async with httpx.AsyncClient() as http:

            async def code(r: httpx.Response) -> tuple[int, str]:
                return r.status_code, r.json()["error"]["code"]

            assert await code(await http.post(f"{base}/calls", content="v=0")) == (401, "invalid_api_key")
            sdp = {**auth, "Content-Type": "application/sdp"}
            assert await code(await http.post(f"{base}/calls", content="", headers=sdp)) == (
                400,
                "invalid_sdp",
            )
            assert await code(await http.post(f"{base}/calls", content="v=0\r\nnonsense", headers=sdp)) == (
                400,
                "invalid_sdp",
            )
            multipart = {**auth, "Content-Type": "multipart/form-data; boundary=x"}
            assert (await http.post(f"{base}/calls", content="garbage", headers=multipart)).status_code == 400
            assert await code(await http.get(f"{base}/calls", headers=auth)) == (405, "method_not_allowed")
            assert await code(await http.post(f"{base}/calls/rtc_nope/hangup", headers=auth)) == (
                404,
                "call_not_found",
            )
            big = await http.post(f"{base}/calls", content="x" * (MAX_BODY_BYTES + 1), headers=sdp)
            assert big.status_code == 413
            bad = {"session": {"audio": {"output": {"voice": "nobody"}}}}
            assert await code(await http.post(f"{base}/client_secrets", json=bad, headers=auth)) == (
                400,
                "invalid_value",
            )
            short = {"expires_after": {"anchor": "created_at", "seconds": 1}}
            assert (await http.post(f"{base}/client_secrets", json=short, headers=auth)).status_code == 400
            # Only created_at is an anchor (OpenAI's one); another was taken for it.
            other = {"expires_after": {"anchor": "first_use", "seconds": 60}}
            r = await http.post(f"{base}/client_secrets", json=other, headers=auth)
            assert (r.status_code, r.json()["error"]["param"]) == (400, "expires_after.anchor")
            # Nothing of it held a session slot: a call still fits the one slot.
            assert not server.peers and engine.open_sessions == 0


async def test_a_key_with_a_session_the_server_would_refuse_is_not_minted():
    """A session that only applying it shows bad (a transcription that is not an object) is HTTP 400
    when the key is asked for, as a bad voice is; it was minted with HTTP 500 and a traceback."""
    async with Server(FakeEngine(step_s=0.0), ServerSettings(port=0, token="tk")) as server:
        base = f"{server_url(server)}/v1/realtime"
        auth = {"Authorization": "Bearer tk"}
        bad = {"session": {"type": "realtime", "audio": {"input": {"transcription": 5}}}}
        async with httpx.AsyncClient() as http:
            r = await http.post(f"{base}/client_secrets", json=bad, headers=auth)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert (error["code"], error["param"]) == ("invalid_value", "session.audio.input.transcription")
            assert not server.rest.keys
            r = await http.post(
                f"{base}/client_secrets", json={"session": {"max_output_tokens": 0}}, headers=auth
            )
            assert (r.status_code, r.json()["error"]["param"]) == (400, "session.max_output_tokens")


async def test_a_page_of_an_allowed_origin_can_call_the_endpoints_cross_origin():
    """OpenAI's browser flow POSTs the offer to the realtime server, another origin than the page's:
    the browser asks first (an OPTIONS preflight) and reads the answer only with CORS headers. The
    preflight was 405 and no answer carried them, so an allowed origin's page could not make a call."""
    page = "http://app.example:3000"
    settings = ServerSettings(port=0, token="tk", allowed_origins=(page,))
    async with Server(FakeEngine(step_s=0.0), settings) as server:
        base = f"{server_url(server)}/v1/realtime"
        asks = {
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        }
        async with httpx.AsyncClient() as http:
            r = await http.options(f"{base}/calls", headers={"Origin": page, **asks})
            assert r.status_code == 204
            assert r.headers["access-control-allow-origin"] == page
            assert "POST" in r.headers["access-control-allow-methods"]
            assert r.headers["access-control-allow-headers"] == "authorization,content-type"
            r = await http.post(
                f"{base}/client_secrets", json={}, headers={"Origin": page, "Authorization": "Bearer tk"}
            )
            assert r.status_code == 200 and r.headers["access-control-allow-origin"] == page
            assert r.headers["access-control-expose-headers"] == "Location"  # the call's id, for its hangup
            r = await http.get(f"{base}/calls", headers={"Authorization": "Bearer tk"})
            assert (r.status_code, r.headers["allow"]) == (405, "POST")
            # Another origin is refused, its preflight too.
            r = await http.options(f"{base}/calls", headers={"Origin": "http://evil.example", **asks})
            assert r.status_code == 403 and "access-control-allow-origin" not in r.headers


async def test_an_event_too_large_for_a_calls_channel_is_reported_and_the_call_goes_on():
    """A call has no socket to carry what its data channel cannot (over the client's max-message-size):
    the echo of a long message (sent as UTF-8, 4 bytes an emoji; echoed escaped, 12) ended the call
    with a server_error; now the client is told what it missed and the call keeps serving."""
    engine = FakeEngine(step_s=0.0, reply="ok")
    async with Server(engine, ServerSettings(port=0, token="tk")) as server:
        async with httpx.AsyncClient() as http:
            pc, channel, events, _ = await call(http, server)

            async def until(type_: str) -> list[dict]:
                seen = [await asyncio.wait_for(events.get(), 10)]
                while seen[-1]["type"] != type_:
                    seen.append(await asyncio.wait_for(events.get(), 10))
                return seen

            await until("session.created")
            parts = [{"type": "input_text", "text": "\N{GRINNING FACE}" * 15_000} for _ in range(3)]
            item = {"type": "message", "role": "user", "content": parts}
            channel.send(json.dumps({"type": "conversation.item.create", "item": item}, ensure_ascii=False))
            channel.send(json.dumps({"type": "response.create"}))
            seen = await until("response.done")
            errors = [e["error"] for e in seen if e["type"] == "error"]
            assert [e["code"] for e in errors] == ["event_too_large"] * 2  # item.added, item.done
            assert "conversation.item.added" in errors[0]["message"]
            assert seen[-1]["response"]["status"] == "completed" and len(server.peers) == 1
            assert engine.requests == ["\n".join(p["text"] for p in parts)]
        await pc.close()


async def test_a_call_whose_connection_never_comes_up_gives_its_slot_back(monkeypatch):
    """An offer sent before ICE gathering finished (no candidates: a page that did not wait) was
    answered, and its WebRTC connection stayed "new" for good: the call held a session slot until the
    server stopped. A call not connected within the deadline has failed, as one whose ICE failed has."""
    import re

    from omni_rt.server import media

    monkeypatch.setattr(media, "CONNECT_TIMEOUT_S", 0.5)
    engine = FakeEngine(step_s=0.0)
    async with Server(engine, ServerSettings(port=0, token="tk")) as server:
        pc = RTCPeerConnection()
        pc.addTransceiver("audio", direction="recvonly")
        pc.createDataChannel("oai-events")
        await pc.setLocalDescription(await pc.createOffer())
        offer = re.sub(r"a=candidate:.*\r\n", "", pc.localDescription.sdp)
        async with httpx.AsyncClient() as http:
            r = await http.post(
                f"{server_url(server)}/v1/realtime/calls",
                content=offer,
                headers={"Authorization": "Bearer tk", "Content-Type": "application/sdp"},
            )
            assert r.status_code == 201 and len(server.peers) == 1
            async with asyncio.timeout(10):
                while server.peers or engine.open_sessions:
                    await asyncio.sleep(0.05)
            assert not server.rest.calls
        await pc.close()
