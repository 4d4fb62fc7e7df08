"""End to end through `/ws`: an aiortc client in the test, a data channel for events, an audio track back."""

import asyncio
import json
import time

import numpy as np
import pytest

pytest.importorskip("aiortc")

import aioice.ice  # noqa: E402
import websockets  # noqa: E402
from aiortc import RTCConfiguration, RTCPeerConnection  # noqa: E402
from server_fakes import Client, FakeEngine, RecordingEngine, loopback_ice, user_message  # noqa: E402, F401

from omni_rt.config import Sampling  # noqa: E402
from omni_rt.server import PeerSettings, Server, ServerSettings, webrtc  # noqa: E402
from omni_rt.server.track import FRAME_SAMPLES, SAMPLE_RATE, AudioOutputTrack  # noqa: E402

FRAME_S = FRAME_SAMPLES / SAMPLE_RATE
CODEC_FRAME_S = 0.080


@pytest.fixture
def sent_frames(monkeypatch) -> list[tuple[float, int, bool]]:
    """(time, pts, audible) of every frame the server's tracks hand to aiortc's sender."""
    sent: list[tuple[float, int, bool]] = []
    recv = AudioOutputTrack.recv

    async def logged(self):
        frame = await recv(self)
        sent.append((time.monotonic(), frame.pts, bool(frame.to_ndarray().any())))
        return frame

    monkeypatch.setattr(AudioOutputTrack, "recv", logged)
    return sent


def audible(frame) -> bool:
    samples = frame.to_ndarray().astype(np.float64)
    return np.sqrt(np.mean(samples**2)) > 300  # the tone is 6000; decoded silence is ~0


# aiortc's receiver holds the newest 4 audio packets back (JitterBuffer prefetch=4) until later ones
# arrive. With idle="nothing" nothing follows a reply, so its last 4 frames stay there; a browser's
# jitter buffer plays out on its own clock and has no such tail.
AIORTC_PREFETCH = 4


@pytest.mark.parametrize("idle", ["nothing", "silence"])
async def test_reply_over_data_channel_and_audio_track(idle, sent_frames):
    engine = FakeEngine(step_s=0.03, frames_per_word=2, reply="one two three four five six seven eight")
    async with Server(engine, ServerSettings(port=0, peer=PeerSettings(idle=idle))) as server:
        async with websockets.connect(f"ws://127.0.0.1:{server.port}/ws") as ws:
            client = Client(ws)
            created = await client.connect()
            assert created["type"] == "session.created"
            assert created["session"]["audio"]["output"]["voice"] == "ethan"
            client.say("hello")
            events = await client.until("response.done", "output_audio_buffer.stopped")
            await asyncio.sleep(0.3)  # the last packets are still in flight and in aiortc's jitter buffer

            types = [e["type"] for e in events]
            assert types.index("response.created") < types.index("response.output_audio_transcript.delta")
            assert types.index("output_audio_buffer.started") < types.index("output_audio_buffer.stopped")
            transcript = "".join(
                e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta"
            )
            assert transcript == "one two three four five six seven eight"  # all deltas, in order
            done = next(e for e in events if e["type"] == "response.done")["response"]
            assert done["status"] == "completed"
            assert done["metrics"]["ttfa_ms"] > 0 and done["metrics"]["ttft_ms"] > 0
            assert done["output"][0]["content"][0]["transcript"] == transcript

            session = engine.sessions[0]
            pcm_s = session.pcm_samples[done["id"]] / 24000

            # What the server's track sent: contiguous pts, paced, never ahead of real time.
            sent = [s for s in sent_frames if s[2]] if idle == "nothing" else sent_frames
            assert sum(s[2] for s in sent) * FRAME_S == pytest.approx(pcm_s, abs=CODEC_FRAME_S)
            pts = [p for _, p, _ in sent]
            assert np.all(np.diff(pts) == FRAME_SAMPLES)
            t0, p0 = sent[0][0], sent[0][1]
            ahead = [(p - p0) / SAMPLE_RATE - (t - t0) for t, p, _ in sent]
            assert max(ahead) <= 3 * FRAME_S

            # What the client received and decoded: the same duration of non-silent audio.
            got = [f for _, f in client.frames]
            assert got, "no audio frames arrived"
            assert all(f.sample_rate == SAMPLE_RATE and f.samples == FRAME_SAMPLES for f in got)
            assert np.all(np.diff([f.pts for f in got]) == FRAME_SAMPLES)
            heard = sum(audible(f) for f in got) + (AIORTC_PREFETCH if idle == "nothing" else 0)
            assert heard * FRAME_S == pytest.approx(pcm_s, abs=CODEC_FRAME_S + 1e-9)
            # Received in real time too: never more than a few frames ahead of the wall clock.
            r0 = client.frames[0][0]
            lead = [i * FRAME_S - (t - r0) for i, (t, _) in enumerate(client.frames)]
            assert max(lead) <= 8 * FRAME_S  # looser than the sender's check: network and jitter buffer
            await client.close()


async def test_cancel_mid_reply_clears_audio_and_the_next_reply_works():
    engine = FakeEngine(step_s=0.02, frames_per_word=4, reply=" ".join(["word"] * 40))
    async with Server(engine, ServerSettings(port=0)) as server:
        async with websockets.connect(f"ws://127.0.0.1:{server.port}/ws") as ws:
            client = Client(ws)
            await client.connect()
            client.say("talk for a while")
            await client.until("output_audio_buffer.started")
            client.send({"type": "response.cancel"})
            events = await client.until("response.done")
            done = next(e for e in events if e["type"] == "response.done")
            assert done["response"]["status"] == "cancelled"
            assert "output_audio_buffer.cleared" in [e["type"] for e in events]
            (peer,) = server.peers
            assert peer.track.buffered_ms == 0
            steps = engine.steps
            await asyncio.sleep(0.2)
            assert engine.steps == steps  # the model stopped

            engine.reply = "again"
            client.say("once more")
            events = await client.until("response.done")
            assert events[-1]["response"]["status"] == "completed"
            await client.close()


def created_id(events: list[dict]) -> str:
    return next(e for e in events if e["type"] == "response.created")["response"]["id"]


async def test_playout_outlasting_the_response_can_be_cut():
    # Generation is instant here, so response.done comes long before the audio has played.
    engine = FakeEngine(step_s=0.0, frames_per_word=5, reply=" ".join(["la"] * 30))  # 12 s of audio
    async with Server(engine, ServerSettings(port=0)) as server:
        async with websockets.connect(f"ws://127.0.0.1:{server.port}/ws") as ws:
            client = Client(ws)
            await client.connect()
            (peer,) = server.peers
            client.say("sing")
            first = await client.until("response.done", "output_audio_buffer.started")
            rid = created_id(first)
            assert peer.track.response_id == rid  # still playing after response.done

            # A new request: the old reply's unplayed audio goes; the new one plays at once.
            engine.reply = "short"
            client.say("stop singing")
            events = await client.until("output_audio_buffer.stopped", timeout=5)
            cleared = [e for e in events if e["type"] == "output_audio_buffer.cleared"]
            assert [e["response_id"] for e in cleared] == [rid]
            second = created_id(events)
            assert events[-1]["response_id"] == second

            # output_audio_buffer.clear cuts off a reply that is only playing.
            engine.reply = " ".join(["la"] * 30)
            client.say("again")
            third = created_id(await client.until("response.done", "output_audio_buffer.started"))
            client.send({"type": "output_audio_buffer.clear"})
            events = await client.until("output_audio_buffer.cleared")
            assert events[-1]["response_id"] == third
            assert peer.track.response_id is None and peer.track.buffered_ms == 0
            await client.close()


async def test_socket_only_client_gets_base64_audio():
    engine = FakeEngine(step_s=0.0, frames_per_word=1, reply="a b c")
    async with Server(engine, ServerSettings(port=0)) as server:
        async with websockets.connect(f"ws://127.0.0.1:{server.port}/ws") as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
            await ws.send(json.dumps(user_message("hi")))
            await ws.send(
                json.dumps({"type": "response.create", "response": {"output_modalities": ["audio", "text"]}})
            )
            events = []
            while not events or events[-1]["type"] != "response.done":
                events.append(json.loads(await asyncio.wait_for(ws.recv(), 5)))
            audio = [e for e in events if e["type"] == "response.output_audio.delta"]
            import base64

            pcm = np.frombuffer(b"".join(base64.b64decode(e["delta"]) for e in audio), dtype="<i2")
            assert pcm.size == 3 * 1920  # three 80 ms chunks at 24 kHz, as the session made them
            text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
            assert text == "a b c"
            assert "response.output_audio.done" in [e["type"] for e in events]


@pytest.fixture(scope="module")
def tiny():
    import omni_rt

    return omni_rt.Engine.load("tiny")  # seeded random weights: noise for speech, but the real pipeline


async def test_tiny_engine_reply_over_webrtc(tiny, sent_frames):
    """The done-when test on the real engine: audio duration, pts, pacing and metrics end to end."""
    engine = RecordingEngine(tiny, sampling=Sampling(seed=0))  # 20 frames: a fresh seed once had 6
    # idle="nothing": only the reply's frames go out, so they are what is counted and paced here.
    peer = PeerSettings(max_output_tokens=16, max_audio_frames=20, idle="nothing")
    settings = ServerSettings(port=0, peer=peer)
    async with tiny, Server(engine, settings) as server:
        async with websockets.connect(f"ws://127.0.0.1:{server.port}/ws") as ws:
            client = Client(ws)
            await client.connect()
            client.say("Hello there!")
            events = await client.until("response.done", "output_audio_buffer.stopped", timeout=60)
            await asyncio.sleep(0.3)
            types = [e["type"] for e in events]
            assert types.index("response.created") < types.index("output_audio_buffer.started")
            done = next(e for e in events if e["type"] == "response.done")["response"]
            assert done["status"] in ("completed", "incomplete")  # random weights may use every token
            metrics = done["metrics"]
            assert 0 < metrics["ttft_ms"] <= metrics["ttfa_ms"] < metrics["total_ms"]
            assert done["usage"]["audio_frames"] == 20
            # The tiny tokenizer's random tokens rarely decode to text; whatever arrived is in order
            # and adds up to the transcript the response reports.
            deltas = [e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta"]
            assert "".join(deltas) == done["output"][0]["content"][0]["transcript"]

            assert engine.sample_rate == 24000
            pcm_s = engine.pcm_samples[done["id"]] / 24000
            assert pcm_s == pytest.approx(20 * CODEC_FRAME_S, abs=CODEC_FRAME_S)
            sent = [s for s in sent_frames if s[2]]
            assert len(sent) * FRAME_S == pytest.approx(pcm_s, abs=CODEC_FRAME_S)
            assert np.all(np.diff([p for _, p, _ in sent]) == FRAME_SAMPLES)
            t0, p0 = sent[0][0], sent[0][1]
            assert max((p - p0) / SAMPLE_RATE - (t - t0) for t, p, _ in sent) <= 3 * FRAME_S

            got = [f for _, f in client.frames]
            assert np.all(np.diff([f.pts for f in got]) == FRAME_SAMPLES)
            samples = np.concatenate([f.to_ndarray().reshape(-1) for f in got]).astype(np.float64)
            assert np.sqrt(np.mean(samples**2)) > 300  # the model's audio, not silence
            assert (len(got) + AIORTC_PREFETCH) * FRAME_S == pytest.approx(pcm_s, abs=CODEC_FRAME_S + 1e-9)
            await client.close()


async def test_send_only_offer_gets_its_audio_as_events():
    # A client that only sends audio (a microphone) cannot play a track: the reply comes as base64.
    engine = FakeEngine(step_s=0.0, reply="a b")
    async with Server(engine, ServerSettings(port=0)) as server:
        async with websockets.connect(f"ws://127.0.0.1:{server.port}/ws") as ws:
            client = Client(ws)
            client.direction = "sendonly"
            await client.connect()
            (peer,) = server.peers
            assert peer.track is None
            client.say("hi")
            events = await client.until("response.done")
            audio = [e for e in events if e["type"] == "response.output_audio.delta"]
            assert len(audio) == 2
            # The client's microphone is read as it arrives (counted; speech input is not in the Session).
            async with asyncio.timeout(5):
                while peer.input_audio_frames < 10:
                    await asyncio.sleep(0.05)
            await client.close()


async def test_two_browsers_at_once_each_get_their_own_session():
    engine = FakeEngine(step_s=0.02, frames_per_word=1)  # replies "you said <text>"
    async with Server(engine, ServerSettings(port=0)) as server:
        async with (
            websockets.connect(f"ws://127.0.0.1:{server.port}/ws") as ws_a,
            websockets.connect(f"ws://127.0.0.1:{server.port}/ws") as ws_b,
        ):
            a, b = Client(ws_a), Client(ws_b)
            await asyncio.gather(a.connect(), b.connect())
            a.say("apples")
            b.say("bananas")
            events_a, events_b = await asyncio.gather(
                a.until("output_audio_buffer.stopped", "response.done"),
                b.until("output_audio_buffer.stopped", "response.done"),
            )
            for events, word in ((events_a, "apples"), (events_b, "bananas")):
                text = "".join(
                    e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta"
                )
                assert text == f"you said {word}"
            assert len(server.peers) == 2 and engine.open_sessions == 2
            await asyncio.sleep(0.3)
            assert a.frames and b.frames  # each heard its own track
            await a.close()
            await b.close()


async def test_events_larger_than_the_channel_takes_still_arrive():
    # A data channel takes messages up to 256 KiB (aiortc's and Chromium's max-message-size): a 5 s
    # audio chunk as base64, or the echo of a long user message (non-ASCII is escaped, 6 bytes a
    # character), is more than that. Audio goes as smaller deltas; an event that still does not fit
    # goes on the socket; the connection keeps serving.
    engine = FakeEngine(step_s=0.0, frames_per_word=60, reply="a b")
    async with Server(engine, ServerSettings(port=0)) as server:
        async with websockets.connect(f"ws://127.0.0.1:{server.port}/ws") as ws:
            client = Client(ws)
            client.direction = "sendonly"  # the reply's audio comes as events on the channel
            await client.connect()
            client.say("hi")
            events = await client.until("response.done")
            assert events[-1]["response"]["status"] == "completed"
            audio = [e for e in events if e["type"] == "response.output_audio.delta"]
            assert sum(len(e["delta"]) for e in audio) * 3 // 4 == 2 * 2 * 60 * 1920  # every sample
            assert all(len(json.dumps(e)) < 65536 for e in audio)

            parts = [{"type": "input_text", "text": "语音" * 8000} for _ in range(3)]
            item = {"type": "message", "role": "user", "content": parts}
            await ws.send(json.dumps({"type": "conversation.item.create", "item": item}, ensure_ascii=False))
            added = json.loads(await asyncio.wait_for(ws.recv(), 5))
            assert added["type"] == "conversation.item.added"
            assert added["item"]["content"][0]["text"] == "\n".join(p["text"] for p in parts)
            client.send({"type": "response.create"})
            events = await client.until("response.done")
            assert events[-1]["response"]["status"] == "completed"
            await client.close()


async def test_offered_video_is_declined():
    # The server has no use for video: decoding it would cost CPU for nothing, so the answer sets
    # video inactive and the client sends none.
    from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
    from aiortc.mediastreams import VideoStreamTrack

    engine = FakeEngine(step_s=0.0, reply="a b")
    async with Server(engine, ServerSettings(port=0)) as server:
        async with websockets.connect(f"ws://127.0.0.1:{server.port}/ws") as ws:
            await ws.recv()  # session.created
            pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
            camera = VideoStreamTrack()
            pc.addTransceiver(camera, direction="sendonly")
            pc.addTransceiver("audio", direction="recvonly")
            pc.createDataChannel("events")
            await pc.setLocalDescription(await pc.createOffer())
            await ws.send(json.dumps({"type": "webrtc.offer", "sdp": pc.localDescription.sdp}))
            answer = json.loads(await asyncio.wait_for(ws.recv(), 10))
            video = answer["sdp"].split("m=video")[1].split("m=")[0]
            assert "a=inactive" in video
            await pc.setRemoteDescription(RTCSessionDescription(sdp=answer["sdp"], type="answer"))
            (peer,) = server.peers
            async with asyncio.timeout(10):
                while pc.connectionState != "connected":
                    await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)
            assert peer.input_audio_frames == 0  # no video frame reached the server's readers
            camera.stop()
            await pc.close()


async def test_a_bug_in_a_peer_task_closes_that_connection_not_silently():
    # The track feeder dying would leave the reply unplayed and the client waiting for it forever:
    # like a bug in the main loop, it costs this client its connection (1011), with an error first.
    engine = FakeEngine(step_s=0.0, reply="a b c")
    async with Server(engine, ServerSettings(port=0)) as server:
        async with websockets.connect(f"ws://127.0.0.1:{server.port}/ws") as ws:
            client = Client(ws)
            await client.connect()
            (peer,) = server.peers

            async def broken(*args, **kwargs):
                raise RuntimeError("a bug")

            peer.track.write = broken
            client.say("hi")
            error = json.loads(await asyncio.wait_for(ws.recv(), 5))
            assert error["type"] == "error" and error["error"]["code"] == "server_error"
            with pytest.raises(websockets.ConnectionClosed):
                await asyncio.wait_for(ws.recv(), 5)
            assert ws.close_code == 1011
            await client.close()
        async with asyncio.timeout(5):
            while server.peers or engine.open_sessions:
                await asyncio.sleep(0.02)


async def test_negotiation_mistakes_and_a_client_gone_mid_offer():
    engine = FakeEngine(step_s=0.0, reply="ok")
    async with Server(engine, ServerSettings(port=0)) as server:
        async with websockets.connect(f"ws://127.0.0.1:{server.port}/ws") as ws:
            client = Client(ws)
            await client.connect()
            # A second offer is refused; the first connection keeps working.
            offer = {"type": "webrtc.offer", "sdp": client.pc.localDescription.sdp, "event_id": "o2"}
            await ws.send(json.dumps(offer))
            error = (await client.until("error"))[-1]  # on the channel, as every event once it is open
            assert (error["error"]["code"], error["error"]["event_id"]) == ("renegotiation_unsupported", "o2")
            # A data channel of another name is closed; events stay on "events".
            other = client.pc.createDataChannel("oai-events")
            async with asyncio.timeout(5):
                while other.readyState != "closed":
                    await asyncio.sleep(0.05)
            client.say("hi")
            assert (await client.until("response.done"))[-1]["response"]["status"] == "completed"
            await client.close()

        # Offers whose client is gone before the answer: nothing is left behind.
        for _ in range(5):
            ws = await websockets.connect(f"ws://127.0.0.1:{server.port}/ws")
            await ws.recv()
            pc = Client(ws).pc
            pc.addTransceiver("audio", direction="sendrecv")
            pc.createDataChannel("events")
            await pc.setLocalDescription(await pc.createOffer())
            await ws.send(json.dumps({"type": "webrtc.offer", "sdp": pc.localDescription.sdp}))
            ws.transport.abort()
            await pc.close()
        async with asyncio.timeout(10):
            while server.peers or engine.open_sessions:
                await asyncio.sleep(0.05)


def malformed_offer(sdp: str) -> str:
    """An offer aiortc takes apart only halfway: its audio `a=mid` is outside `a=group:BUNDLE 0 1`,
    and no candidates. The answer fails (invalid_sdp), and closing that connection raises in aiortc."""
    lines = [line for line in sdp.splitlines() if not line.startswith("a=candidate:")]
    mid = next(i for i, line in enumerate(lines) if line == "a=mid:0")
    lines[mid] = "a=mid:x"
    return "\r\n".join(lines) + "\r\n"


async def test_a_malformed_offer_gives_its_session_slot_back():
    """Issue #13, defect 1: each cleanup step runs even if the one before it raised, so the session
    slot is released; four such offers once locked every new client out of a 4-slot server."""
    engine = FakeEngine(step_s=0.0, reply="ok", max_sessions=2)
    async with Server(engine, ServerSettings(port=0, max_sessions=2)) as server:
        pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        pc.addTransceiver("audio", direction="sendrecv")
        pc.createDataChannel("events")
        await pc.setLocalDescription(await pc.createOffer())
        sdp = malformed_offer(pc.localDescription.sdp)
        await pc.close()
        assert "a=group:BUNDLE 0 1" in sdp and "a=mid:x" in sdp
        for _ in range(3):  # more offers than slots
            async with websockets.connect(f"ws://127.0.0.1:{server.port}/ws") as ws:
                assert json.loads(await ws.recv())["type"] == "session.created"
                await ws.send(json.dumps({"type": "webrtc.offer", "sdp": sdp}))
                error = json.loads(await ws.recv())
                assert error["error"]["code"] == "invalid_sdp"
                await ws.wait_closed()
                assert ws.close_code == 1008
            async with asyncio.timeout(10):
                while server.peers or engine.open_sessions:
                    await asyncio.sleep(0.02)
        async with websockets.connect(f"ws://127.0.0.1:{server.port}/ws") as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
            await ws.send(json.dumps(user_message("still there?")))
            await ws.send(json.dumps({"type": "response.create"}))
            while (event := json.loads(await ws.recv()))["type"] != "response.done":
                pass
            assert event["response"]["status"] == "completed"


def test_ice_candidates_follow_the_bind_address(monkeypatch):
    """Issue #13, defect 7: loopback only on loopback, the bound interface when bound to one, every
    interface (and STUN/TURN) only when bound to all; a public address announced behind a NAT."""
    IcePolicy = webrtc.IcePolicy
    assert IcePolicy.for_bind("127.0.0.1", ["stun:s:3478"]) == IcePolicy(("127.0.0.1",), ())
    assert IcePolicy.for_bind("localhost").addresses == ("127.0.0.1",)
    assert IcePolicy.for_bind("::1").addresses == ("::1",)
    assert IcePolicy.for_bind("10.1.2.3").addresses == ("10.1.2.3",)
    assert IcePolicy.for_bind("0.0.0.0", ["stun:s:3478"]) == IcePolicy(None, ("stun:s:3478",))
    assert IcePolicy.for_bind("").addresses is None
    with pytest.raises(ValueError):
        IcePolicy(public_address="example.com")

    # What aioice gathers on: the policy of the connection being answered, else everything.
    monkeypatch.setattr(webrtc, "_gather_all", lambda use_ipv4, use_ipv6: ["192.168.1.5", "127.0.0.1"])
    assert aioice.ice.get_host_addresses(use_ipv4=True, use_ipv6=False) == ["192.168.1.5", "127.0.0.1"]
    token = webrtc._policy.set(IcePolicy(("127.0.0.1",)))
    try:
        assert aioice.ice.get_host_addresses(use_ipv4=True, use_ipv6=True) == ["127.0.0.1"]
    finally:
        webrtc._policy.reset(token)

    answer = "\r\n".join(
        [
            "c=IN IP4 10.0.0.2",
            "a=candidate:1 1 udp 2130706431 10.0.0.2 40000 typ host",
            "a=candidate:2 1 udp 1694498815 198.51.100.1 40000 typ srflx raddr 10.0.0.2 rport 40000",
        ]
    )
    announced = webrtc._announce(answer, IcePolicy(("10.0.0.2",), (), "203.0.113.7")).split("\r\n")
    assert announced[0] == "c=IN IP4 203.0.113.7"
    assert announced[1] == "a=candidate:1 1 udp 2130706431 203.0.113.7 40000 typ host"
    assert announced[2].startswith("a=candidate:2 1 udp 1694498815 198.51.100.1")


async def test_the_reply_track_holds_the_lead_the_engines_chunk_plan_counts_on():
    from omni_rt.config import EngineSettings

    engine = FakeEngine()  # no settings: no lead
    assert Server(engine, ServerSettings(port=0)).settings.peer.start_lead_ms == 0
    engine.settings = EngineSettings().for_device("cpu")
    assert Server(engine, ServerSettings(port=0)).settings.peer.start_lead_ms == 100
    chosen = ServerSettings(port=0, peer=PeerSettings(start_lead_ms=20))
    assert Server(engine, chosen).settings.peer.start_lead_ms == 20
