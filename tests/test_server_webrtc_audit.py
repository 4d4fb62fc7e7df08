"""An outside tester's audit of the WebRTC and REST paths: offers as real clients make them, and the
HTTP mistakes they make, against `/v1/realtime/calls` (aiortc as the browser, as OpenAI's WebRTC guide
connects one)."""

import asyncio
import json

import httpx
import numpy as np
import pytest

pytest.importorskip("aiortc")

from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription  # noqa: E402
from server_fakes import FakeEngine, MicTrack, loopback_ice, speech_like, user_message  # noqa: E402, F401
from test_server_static import http as raw_http  # noqa: E402

from omni_rt.server import Server, ServerSettings, transport  # noqa: E402
from omni_rt.server.http import MAX_BODY_BYTES  # noqa: E402

AUTH = {"Authorization": "Bearer tk"}


def calls_url(server: Server) -> str:
    return f"http://127.0.0.1:{server.port}/v1/realtime/calls"


async def offer_call(http: httpx.AsyncClient, server: Server, pc: RTCPeerConnection) -> httpx.Response:
    """POST `pc`'s offer as a raw-SDP call and apply the answer."""
    await pc.setLocalDescription(await pc.createOffer())
    r = await http.post(
        calls_url(server),
        content=pc.localDescription.sdp,
        headers={**AUTH, "Content-Type": "application/sdp"},
    )
    assert r.status_code == 201, r.text
    await pc.setRemoteDescription(RTCSessionDescription(sdp=r.text, type="answer"))
    return r


def directions(sdp: str) -> list[tuple[str, str]]:
    """(media kind, direction) of each m-section of an SDP."""
    out: list[tuple[str, str]] = []
    for line in sdp.splitlines():
        if line.startswith("m="):
            out.append((line[2:].split(" ")[0], ""))
        elif line[2:] in ("sendrecv", "sendonly", "recvonly", "inactive") and out:
            out[-1] = (out[-1][0], line[2:])
    return out


async def until_requests(engine: FakeEngine, n: int) -> None:
    """Until the engine was asked for `n` replies and none is running."""
    async with asyncio.timeout(20):
        while len(engine.requests) < n or engine.running:
            await asyncio.sleep(0.02)


async def test_a_call_without_a_data_channel_keeps_serving_its_voice(monkeypatch):
    """A voice-only call (a microphone, no `oai-events` channel) has nowhere to send its events. They
    were held for a channel that never comes, and when the hold was full (1,024 events: a few
    replies' transcript deltas) the call was dropped as a client that stopped reading."""
    monkeypatch.setattr(transport, "OUTBOX_SIZE", 8)  # a turn and its reply send more than this
    engine = FakeEngine(step_s=0.0, reply="one two three four five six seven eight nine ten")
    async with Server(engine, ServerSettings(port=0, token="tk")) as server, httpx.AsyncClient() as http:
        pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        mic = MicTrack()
        pc.addTransceiver(mic, direction="sendrecv")
        await offer_call(http, server, pc)
        for turn in (1, 2):  # server VAD answers each spoken turn
            mic.play(speech_like(0.8, 48000, seed=turn))
            await until_requests(engine, turn)
        (peer,) = server.peers
        assert not peer.transport._early  # nothing held for a channel that will not come
        mic.stop()
        await pc.close()


async def test_a_second_audio_section_is_not_a_second_microphone():
    """An offer with two sending audio sections (two tracks added): both were read as the one
    microphone, their frames interleaved in one input buffer, so the server heard neither right.
    The first is the microphone; another sending one is answered without receiving."""
    engine = FakeEngine(step_s=0.0, reply="ok")
    async with Server(engine, ServerSettings(port=0, token="tk")) as server, httpx.AsyncClient() as http:
        pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        first, second = MicTrack(), MicTrack()
        pc.addTransceiver(first, direction="sendrecv")
        pc.addTransceiver(second, direction="sendrecv")
        channel = pc.createDataChannel("oai-events")
        events: asyncio.Queue = asyncio.Queue()
        channel.on("message", lambda m: events.put_nowait(json.loads(m)))
        r = await offer_call(http, server, pc)
        assert directions(r.text) == [("audio", "sendrecv"), ("audio", "inactive"), ("application", "")]
        assert (await asyncio.wait_for(events.get(), 10))["type"] == "session.created"
        second.play(speech_like(1.5, 48000))  # a voice on the second track only: not heard
        first.play(np.zeros(2 * 48000, np.float32))  # the first track's clock: 2 s of silence, sent
        await asyncio.wait_for(first.played.wait(), 10)
        channel.send(json.dumps(user_message("hello")))
        channel.send(json.dumps({"type": "response.create"}))
        seen = []
        while (ev := await asyncio.wait_for(events.get(), 10))["type"] != "response.done":
            seen.append(ev["type"])
        assert "input_audio_buffer.speech_started" not in seen
        assert engine.requests == ["hello"]
        first.stop()
        second.stop()
        await pc.close()


async def test_http_mistakes_on_the_call_endpoints_are_openai_json_errors():
    """Every refusal of a REST endpoint is OpenAI's JSON error, which the SDK reads as an
    `APIStatusError` with a code: a refused Origin, a body too large and a malformed Content-Length
    were plain text (the last as 413), and a chunked body (no Content-Length, as a streamed fetch()
    sends one) got no answer at all, the connection dropped."""
    settings = ServerSettings(port=0, token="tk", max_sessions=1)
    engine = FakeEngine(step_s=0.0)
    async with Server(engine, settings) as server, httpx.AsyncClient() as http:
        sdp = {**AUTH, "Content-Type": "application/sdp"}

        def error(r: httpx.Response) -> tuple[int, str]:
            assert r.headers["content-type"] == "application/json", r.text
            return r.status_code, r.json()["error"]["code"]

        r = await http.post(
            calls_url(server), content="v=0", headers={**sdp, "Origin": "http://evil.example"}
        )
        assert error(r) == (403, "origin_not_allowed")
        r = await http.post(calls_url(server), content="x" * (MAX_BODY_BYTES + 1), headers=sdp)
        assert error(r) == (413, "request_too_large")

        async def chunks():
            yield b"v=0\r\n"

        r = await http.post(calls_url(server), content=chunks(), headers=sdp)
        assert error(r) == (411, "length_required")

        status, headers, body = await raw_http(
            server.port,
            b"POST /v1/realtime/calls HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer tk\r\n"
            b"Content-Type: application/sdp\r\nContent-Length: nine\r\n\r\nv=0\r\n",
        )
        assert (status, headers["content-type"]) == (400, "application/json")
        assert json.loads(body)["error"]["code"] == "invalid_request"
        # None of it took the one session slot: a good call still fits.
        assert not server.peers and engine.open_sessions == 0
        pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        pc.addTransceiver("audio", direction="recvonly")
        pc.createDataChannel("oai-events")
        await offer_call(http, server, pc)
        await pc.close()
