"""Speech input over the wire: a microphone track or `input_audio_buffer.append` → server VAD → turns
answered with a spoken reply; manual commit without VAD; barge-in; bad audio."""

import asyncio
import base64
import contextlib
import json
import time

import numpy as np
import pytest

pytest.importorskip("aiortc")

import websockets  # noqa: E402
from audio_clips import needs_espeak, speech  # noqa: E402
from openai_check import validate  # noqa: E402
from server_fakes import (  # noqa: E402, F401
    Client,
    FakeEngine,
    MicTrack,
    RecordingEngine,
    loopback_ice,
    speech_like,
    user_message,
)

from omni_rt.audio.resample import resample  # noqa: E402
from omni_rt.config import Sampling  # noqa: E402
from omni_rt.server import PeerSettings, Server, ServerSettings  # noqa: E402
from omni_rt.server.live_turn import TAIL_MS
from omni_rt.server.track import AudioOutputTrack  # noqa: E402

RATE_IN = 24000  # input_audio_buffer.append


def pcm16_b64(audio: np.ndarray) -> str:
    return base64.b64encode((np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()).decode()


def spoken_turn(rate: int, lead_s: float = 0.2, speech_s: float = 0.8, tail_s: float = 0.8, seed: int = 0):
    """Silence, a voice-like burst, silence: one turn for the server VAD."""
    return np.concatenate(
        [
            np.zeros(int(lead_s * rate), np.float32),
            speech_like(speech_s, rate, seed=seed),
            np.zeros(int(tail_s * rate), np.float32),
        ]
    )


async def append(ws, audio: np.ndarray, chunk_ms: int = 100) -> None:
    n = RATE_IN * chunk_ms // 1000
    for i in range(0, len(audio), n):
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": pcm16_b64(audio[i : i + n])}))


async def recv(ws) -> dict:
    return validate(await asyncio.wait_for(ws.recv(), 10))  # every event, as the SDK's model has it


async def until(ws, type_: str, status: str | None = None) -> list[dict]:
    """Socket events up to the first of `type_` (a response.done with `status`, when given)."""
    events = []
    while True:
        events.append(await recv(ws))
        ev = events[-1]
        if ev["type"] == type_ and (status is None or ev["response"]["status"] == status):
            return events


def types(events: list[dict]) -> list[str]:
    return [e["type"] for e in events]


def check_turn_events(events: list[dict]) -> str:
    """speech_started → speech_stopped → committed → the user item, all for one item id; returns it."""
    t = types(events)
    started, stopped, committed = (
        events[t.index(f"input_audio_buffer.{k}")] for k in ("speech_started", "speech_stopped", "committed")
    )
    assert t.index("input_audio_buffer.speech_started") < t.index("input_audio_buffer.speech_stopped")
    assert t.index("input_audio_buffer.speech_stopped") < t.index("input_audio_buffer.committed")
    item_id = started["item_id"]
    assert stopped["item_id"] == item_id and committed["item_id"] == item_id
    added = next(e for e in events if e["type"] == "conversation.item.added")
    assert added["item"]["id"] == item_id and added["item"]["content"][0]["type"] == "input_audio"
    assert t.index("input_audio_buffer.committed") < t.index("conversation.item.added")
    return item_id


# -- the socket: input_audio_buffer.append ----------------------------------------------------------------


async def test_appended_speech_with_server_vad_gets_a_spoken_reply():
    engine = FakeEngine(step_s=0.0, reply="I heard you")
    async with Server(engine, ServerSettings(port=0)) as server:
        async with websockets.connect(f"ws://127.0.0.1:{server.port}/ws") as ws:
            await recv(ws)  # session.created
            audio = spoken_turn(RATE_IN)
            await append(ws, audio)
            events = await until(ws, "response.done")
            check_turn_events(events)
            t = types(events)
            started = events[t.index("input_audio_buffer.speech_started")]
            stopped = events[t.index("input_audio_buffer.speech_stopped")]
            # speech from 200 ms: the turn starts 300 ms earlier (not before 0) and ends 500 ms after it
            assert started["audio_start_ms"] == 0
            # (Silero's 32 ms frames, and its probability falls a frame or two after the voice)
            assert 1500 <= stopped["audio_end_ms"] <= 1500 + 4 * 32
            assert t.index("conversation.item.added") < t.index("response.created")
            assert "response.output_audio.delta" in t and events[-1]["response"]["status"] == "completed"
            reply_item = events[-1]["response"]["output"][0]["id"]

            # The session got the turn's audio at 16 kHz: what was appended, resampled, up to TAIL_MS
            # after the voice (server_vad's window: 500 ms, in whole 32 ms frames), not the whole window.
            ((turn, rate),) = engine.audio_requests
            assert rate == 16000 and engine.requests == [None]
            assert len(turn) == (stopped["audio_end_ms"] - 16 * 32 + TAIL_MS) * 16
            expected = resample(audio, RATE_IN, 16000)[: len(turn)]
            assert np.abs(turn - expected).max() < 0.01

            # A second turn in the same connection: times keep counting from the buffer's start.
            await append(ws, spoken_turn(RATE_IN, seed=3))
            events = await until(ws, "response.done")
            second = next(e for e in events if e["type"] == "input_audio_buffer.speech_started")
            assert second["audio_start_ms"] >= stopped["audio_end_ms"]
            committed = next(e for e in events if e["type"] == "input_audio_buffer.committed")
            # The conversation: user turn, its reply, then this turn.
            assert committed["previous_item_id"] == reply_item
            assert len(engine.audio_requests) == 2


async def test_without_vad_commit_makes_the_turn_and_response_create_answers_it():
    engine = FakeEngine(step_s=0.0, reply="ok")
    async with Server(engine, ServerSettings(port=0)) as server:
        async with websockets.connect(f"ws://127.0.0.1:{server.port}/ws") as ws:
            await recv(ws)
            await ws.send(
                json.dumps(
                    {"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}}
                )
            )
            assert (await recv(ws))["session"]["audio"]["input"]["turn_detection"] is None

            await ws.send(json.dumps({"type": "input_audio_buffer.commit", "event_id": "c1"}))
            error = await recv(ws)
            assert (
                error["error"]["code"] == "input_audio_buffer_commit_empty"
                and error["error"]["event_id"] == "c1"
            )

            await append(ws, speech_like(0.3, RATE_IN, seed=5))
            await ws.send(json.dumps({"type": "input_audio_buffer.clear"}))
            assert (await recv(ws))["type"] == "input_audio_buffer.cleared"  # no VAD events before it

            speech = spoken_turn(RATE_IN, lead_s=0.0, tail_s=0.1)
            await append(ws, speech)
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            events = [await recv(ws) for _ in range(3)]
            assert types(events) == [
                "input_audio_buffer.committed",
                "conversation.item.added",
                "conversation.item.done",
            ]
            await asyncio.sleep(0.1)
            assert engine.audio_requests == []  # a manual commit does not answer by itself
            await ws.send(json.dumps({"type": "response.create"}))
            done = (await until(ws, "response.done"))[-1]
            assert done["response"]["status"] == "completed"
            ((turn, rate),) = engine.audio_requests
            assert rate == 16000 and len(turn) == pytest.approx(
                len(speech) * 2 // 3, abs=16
            )  # cleared audio is not in it


async def test_instructions_and_system_messages_go_before_a_spoken_turn():
    # response.instructions (and a system message item) with committed speech were refused: a spoken
    # turn took no system turn. They are now one system turn just before it; an assistant message
    # still cannot join a spoken turn.
    engine = FakeEngine(step_s=0.0, reply="ok")
    async with Server(engine, ServerSettings(port=0)) as server:
        async with websockets.connect(f"ws://127.0.0.1:{server.port}/ws") as ws:
            await recv(ws)
            await ws.send(json.dumps({"type": "session.update", "session": {"turn_detection": None}}))
            await recv(ws)

            async def commit_speech() -> None:
                await append(ws, spoken_turn(RATE_IN, lead_s=0.0, tail_s=0.1))
                await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
                await until(ws, "conversation.item.done")

            await commit_speech()
            note = {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "Note."}]}
            await ws.send(json.dumps({"type": "conversation.item.create", "item": note}))
            await until(ws, "conversation.item.done")
            await ws.send(json.dumps({"type": "response.create", "response": {"instructions": "In French."}}))
            assert (await until(ws, "response.done"))[-1]["response"]["status"] == "completed"
            assert len(engine.audio_requests) == 1 and engine.turn_instructions == ["Note.\n\nIn French."]
            assert engine.requests == [None]  # no user text beside the speech

            await commit_speech()
            said = {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Hm."}],
            }
            await ws.send(json.dumps({"type": "conversation.item.create", "item": said}))
            await until(ws, "conversation.item.done")
            await ws.send(json.dumps({"type": "response.create", "event_id": "r2"}))
            error = (await recv(ws))["error"]
            assert (error["code"], error["event_id"]) == ("invalid_value", "r2")


async def test_committed_speech_waiting_for_a_response_is_bounded():
    settings = ServerSettings(port=0, peer=PeerSettings(max_pending_audio_ms=1500, turn_detection=None))
    engine = FakeEngine(step_s=0.0, reply="ok")
    async with Server(engine, settings) as server:
        async with websockets.connect(f"ws://127.0.0.1:{server.port}/ws") as ws:
            await recv(ws)
            await append(ws, speech_like(1.0, RATE_IN))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            assert (await recv(ws))["type"] == "input_audio_buffer.committed"
            await recv(ws), await recv(ws)  # the user item, added and done
            await append(ws, speech_like(1.0, RATE_IN, seed=1))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit", "event_id": "c2"}))
            error = (await recv(ws))["error"]
            assert (error["code"], error["event_id"]) == ("pending_input_full", "c2")
            await ws.send(json.dumps({"type": "response.create"}))
            assert (await until(ws, "response.done"))[-1]["response"]["status"] == "completed"
            ((turn, _),) = engine.audio_requests
            assert len(turn) == pytest.approx(16000, abs=16)  # the first second only


async def test_speech_during_a_reply_cancels_it_then_answers_the_new_turn():
    engine = FakeEngine(step_s=0.02, reply=" ".join(["word"] * 200))
    async with Server(engine, ServerSettings(port=0)) as server:
        async with websockets.connect(f"ws://127.0.0.1:{server.port}/ws") as ws:
            await recv(ws)
            await ws.send(json.dumps(user_message("talk")))
            await ws.send(json.dumps({"type": "response.create"}))
            events = await until(ws, "response.output_audio.delta")
            first = next(e for e in events if e["type"] == "response.created")["response"]["id"]
            engine.reply = "yes?"
            await append(ws, spoken_turn(RATE_IN))
            events = await until(ws, "response.done", status="completed")
            t = types(events)
            barge = t.index("input_audio_buffer.speech_started")
            done = [e for e in events if e["type"] == "response.done"]
            assert done[0]["response"]["id"] == first and done[0]["response"]["status"] == "cancelled"
            # OpenAI's reason for a cut by server VAD (pipecat and livekit tell it from a client's cancel)
            assert done[0]["response"]["status_details"] == {"type": "cancelled", "reason": "turn_detected"}
            assert barge < t.index("response.done")
            late = [
                e
                for e in events[barge:]
                if e["type"] == "response.output_audio.delta" and e["response_id"] == first
            ]
            assert late == []  # nothing of the cancelled reply after the user started speaking
            assert engine.steps < 150  # the long reply stopped
            check_turn_events(events)
            assert done[1]["response"]["id"] != first and len(engine.audio_requests) == 1

            # With interrupt_response off, speech leaves the reply alone; the turn waits for it to end.
            update = {"turn_detection": {"type": "server_vad", "interrupt_response": False}}
            await ws.send(json.dumps({"type": "session.update", "session": {"audio": {"input": update}}}))
            await until(ws, "session.updated")
            engine.reply = " ".join(["more"] * 60)
            await append(ws, spoken_turn(RATE_IN, seed=7))
            third = (await until(ws, "response.created"))[-1]["response"]["id"]
            await asyncio.sleep(0.05)
            engine.reply = "and now you"
            await append(ws, spoken_turn(RATE_IN, seed=8))
            events = await until(ws, "response.done")
            assert (events[-1]["response"]["id"], events[-1]["response"]["status"]) == (third, "completed")
            assert "input_audio_buffer.committed" in types(events)
            answered = (await until(ws, "response.done"))[-1]  # then the waiting turn is answered
            assert answered["response"]["status"] == "completed" and len(engine.audio_requests) == 3


@needs_espeak
async def test_bad_audio_gets_errors_and_the_connection_keeps_serving():
    engine = FakeEngine(step_s=0.0, reply="still here")
    settings = ServerSettings(port=0, peer=PeerSettings(max_turn_ms=1000))
    async with Server(engine, settings) as server:
        async with websockets.connect(f"ws://127.0.0.1:{server.port}/ws") as ws:
            await recv(ws)
            too_long = pcm16_b64(np.zeros(31 * RATE_IN, np.float32))  # 31 s in one append (under 2 MiB)
            bad = [too_long, "%%%not base64%%%", base64.b64encode(b"\x00\x01\x02").decode()]
            for i, audio in enumerate(bad):
                await ws.send(
                    json.dumps({"type": "input_audio_buffer.append", "audio": audio, "event_id": f"b{i}"})
                )
                error = await recv(ws)
                assert error["type"] == "error" and error["error"]["code"] == "invalid_value"
                assert error["error"]["event_id"] == f"b{i}"

            # A turn that reaches the longest turn (1 s here) is ended there; the rest is the next turn.
            # (espeak-ng's voice: Silero hears a long synthetic buzz as less and less like speech)
            voice = resample(speech("What is the capital of France?"), 16000, RATE_IN)
            await append(ws, np.concatenate([voice, np.zeros(RATE_IN, np.float32)]))
            events = await until(ws, "response.done", status="completed")
            stopped = next(e for e in events if e["type"] == "input_audio_buffer.speech_stopped")
            started = next(e for e in events if e["type"] == "input_audio_buffer.speech_started")
            # (at the end of the detector's 32 ms frame that reaches it)
            assert 1000 <= stopped["audio_end_ms"] - started["audio_start_ms"] < 1000 + 32
            assert len(engine.audio_requests[0][0]) == 16 * (
                stopped["audio_end_ms"] - started["audio_start_ms"]
            )
            assert types(events).count("input_audio_buffer.committed") == 2

            # Without VAD, the buffer refuses audio past its size.
            await ws.send(json.dumps({"type": "session.update", "session": {"turn_detection": None}}))
            await until(ws, "session.updated")
            await append(ws, np.zeros(RATE_IN, np.float32), chunk_ms=500)
            await append(ws, np.zeros(RATE_IN // 10, np.float32))
            assert (await recv(ws))["error"]["code"] == "input_audio_buffer_full"

            # conversation.item.truncate: known items only, within their audio.
            done = events[-1]["response"]
            item_id = done["output"][0]["id"]
            await ws.send(
                json.dumps({"type": "conversation.item.truncate", "item_id": "item_x", "audio_end_ms": 0})
            )
            assert (await recv(ws))["error"]["param"] == "item_id"
            await ws.send(
                json.dumps({"type": "conversation.item.truncate", "item_id": item_id, "audio_end_ms": 10**6})
            )
            assert (await recv(ws))["error"]["param"] == "audio_end_ms"
            truncate = {
                "type": "conversation.item.truncate",
                "item_id": item_id,
                "content_index": 0,
                "audio_end_ms": 50,
            }
            await ws.send(json.dumps(truncate))
            truncated = await recv(ws)
            assert truncated["type"] == "conversation.item.truncated" and truncated["audio_end_ms"] == 50
            (peer,) = server.peers
            assert peer.replies.items[item_id].played_ms == 50

            # And the connection still answers.
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            assert (await recv(ws))["type"] == "input_audio_buffer.committed"
            await until(ws, "conversation.item.done")
            await ws.send(json.dumps({"type": "response.create"}))
            assert (await until(ws, "response.done"))[-1]["response"]["status"] == "completed"


# -- WebRTC: the microphone track -------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def with_mic(server):
    """A connected WebRTC client whose microphone plays what the test gives it."""
    async with websockets.connect(f"ws://127.0.0.1:{server.port}/ws") as ws:
        mic = MicTrack()
        client = Client(ws, mic=mic)
        await client.connect()
        try:
            yield client, mic
        finally:
            await client.close()


async def test_microphone_turn_over_webrtc_gets_a_spoken_reply():
    engine = FakeEngine(step_s=0.02, frames_per_word=2, reply="I heard you loud and clear")
    async with Server(engine, ServerSettings(port=0)) as server, with_mic(server) as (client, mic):
        (peer,) = server.peers
        mic.play(spoken_turn(48000, lead_s=0.3))
        events = await client.until("response.done", "output_audio_buffer.started", timeout=15)
        check_turn_events(events)
        t = types(events)
        assert t.index("input_audio_buffer.committed") < t.index("response.created")
        done = next(e for e in events if e["type"] == "response.done")["response"]
        assert done["status"] == "completed"
        started = events[t.index("input_audio_buffer.speech_started")]
        stopped = events[t.index("input_audio_buffer.speech_stopped")]
        # 300 ms prefix + 800 ms of speech + 500 ms of silence, heard through Opus
        assert stopped["audio_end_ms"] - started["audio_start_ms"] == pytest.approx(1600, abs=100)
        ((turn, rate),) = engine.audio_requests
        # what the model hears: up to TAIL_MS after the voice, not the rest of the 512 ms window
        heard = stopped["audio_end_ms"] - 16 * 32 + TAIL_MS - started["audio_start_ms"]
        assert rate == 16000 and len(turn) == heard * 16
        assert np.sqrt(np.mean(turn**2)) > 0.05  # the speech itself, not silence
        await asyncio.sleep(0.2)
        assert peer.input_audio_frames > 50 and client.frames  # the reply came back on the track


async def test_a_turn_that_ends_while_the_session_reopens_is_answered_by_the_new_one(monkeypatch):
    # New instructions before anything was said reopen the session (its first turn says them); the
    # microphone keeps being heard meanwhile. A turn that ends then waits for the new session rather
    # than going to the one being closed.
    from server_fakes import FakeSession

    engine = FakeEngine(step_s=0.0, reply="ok")
    heard: list[str | None] = []
    respond, opened = FakeSession.respond, FakeEngine.session

    def recording_respond(self, *args, **kwargs):
        heard.append(self.instructions)
        return respond(self, *args, **kwargs)

    @contextlib.asynccontextmanager
    async def slow_session(self, **kwargs):
        if kwargs.get("instructions") == "Be brief.":
            await asyncio.sleep(2.5)  # the engine is busy; the turn ends meanwhile
        async with opened(self, **kwargs) as session:
            yield session

    monkeypatch.setattr(FakeSession, "respond", recording_respond)
    monkeypatch.setattr(FakeEngine, "session", slow_session)
    async with Server(engine, ServerSettings(port=0)) as server, with_mic(server) as (client, mic):
        mic.play(spoken_turn(48000, lead_s=0.3))
        client.send({"type": "session.update", "session": {"instructions": "Be brief."}})
        events = await client.until("input_audio_buffer.committed", "session.updated", "response.done")
        t = types(events)
        assert t.index("input_audio_buffer.committed") < t.index("session.updated")  # it did end meanwhile
        assert events[-1]["type"] == "response.done" and events[-1]["response"]["status"] == "completed"
        assert heard == ["Be brief."] and engine.turn_instructions == [None]


@pytest.fixture
def taken_frames(monkeypatch) -> tuple[list[tuple[float, str | None]], list[float]]:
    """(time, response id) of each frame the server's track sends, and the times of its clear()."""
    frames: list[tuple[float, str | None]] = []
    clears: list[float] = []
    take, clear = AudioOutputTrack._take_frame, AudioOutputTrack.clear

    def logged_take(self):
        out = take(self)
        frames.append((time.monotonic(), out[1]))
        return out

    def logged_clear(self):
        clears.append(time.monotonic())
        return clear(self)

    monkeypatch.setattr(AudioOutputTrack, "_take_frame", logged_take)
    monkeypatch.setattr(AudioOutputTrack, "clear", logged_clear)
    return frames, clears


async def test_barge_in_over_webrtc_cuts_the_track_at_once(taken_frames):
    frames, clears = taken_frames
    engine = FakeEngine(step_s=0.02, frames_per_word=4, reply=" ".join(["word"] * 60))  # 19 s of audio
    async with Server(engine, ServerSettings(port=0)) as server, with_mic(server) as (client, mic):
        (peer,) = server.peers
        client.say("talk for a while")
        events = await client.until("output_audio_buffer.started")
        first = next(e for e in events if e["type"] == "response.created")["response"]["id"]
        await asyncio.sleep(0.3)
        engine.reply = "yes?"
        mic.play(spoken_turn(48000, lead_s=0.0))
        events = await client.until("input_audio_buffer.speech_started", "output_audio_buffer.cleared")
        cleared = next(e for e in events if e["type"] == "output_audio_buffer.cleared")
        assert cleared["response_id"] == first
        events += await client.until("response.done")
        assert events[-1]["response"]["id"] == first and events[-1]["response"]["status"] == "cancelled"
        assert peer.track.buffered_ms == 0
        cut = clears[-1]
        old_after_cut = [t for t, rid in frames if rid == first and t > cut]
        assert len(old_after_cut) <= 1  # at most the frame already on its way out
        sent = sum(rid == first for _, rid in frames)
        assert sent < 60 * 4 * 4  # far from all of it was sent
        # The item records what was played, as a conversation.item.truncate would
        truncated = next(e for e in events if e["type"] == "conversation.item.truncated")
        assert truncated["audio_end_ms"] == sent * 20 and peer.replies.items[truncated["item_id"]].id == first

        # The spoken turn is then answered, on the same track.
        events += await client.until("output_audio_buffer.stopped", timeout=15)
        check_turn_events(events)
        done = [e for e in events if e["type"] == "response.done"][-1]["response"]
        assert done["status"] == "completed" and done["id"] != first


# -- the real pipeline -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    import omni_rt

    return omni_rt.Engine.load("tiny")


async def test_tiny_engine_answers_appended_speech(tiny):
    settings = ServerSettings(port=0, peer=PeerSettings(max_output_tokens=8, max_audio_frames=10))
    engine = RecordingEngine(tiny, sampling=Sampling(seed=0))  # exact lengths: not a fresh seed's
    async with tiny, Server(engine, settings) as server:
        async with websockets.connect(f"ws://127.0.0.1:{server.port}/ws") as ws:
            await recv(ws)
            await append(ws, spoken_turn(RATE_IN))
            events = await until(ws, "response.done")
            check_turn_events(events)
            done = events[-1]["response"]
            # random weights: 8 tokens may not end the reply (incomplete, the limit stopped it)
            assert done["status"] in ("completed", "incomplete"), done
            pcm = b"".join(
                base64.b64decode(e["delta"]) for e in events if e["type"] == "response.output_audio.delta"
            )
            assert len(pcm) // 2 == pytest.approx(10 * 0.08 * 24000, abs=0.08 * 24000)
            assert done["usage"]["audio_frames"] == 10
            # the spoken turn is in the prompt: ~13 audio tokens a second, far more than a few words
            assert done["usage"]["input_tokens"] > 15


# -- the buffer itself ------------------------------------------------------------------------------------


def test_input_buffer_downmixes_resamples_and_keeps_time_per_source():
    from omni_rt.server.protocol import TurnDetectionFields
    from omni_rt.server.speech import InputAudioBuffer, TurnDetection

    buf = InputAudioBuffer(None, max_turn_ms=5000)  # no VAD: everything waits for commit
    mono = spoken_turn(48000, lead_s=0.0, tail_s=0.2)
    stereo = np.stack([mono, np.zeros_like(mono)], axis=1).reshape(-1)  # interleaved L/R, right silent
    for i in range(0, len(stereo), 1920):  # 20 ms frames, as aiortc decodes them
        assert buf.push((stereo[i : i + 1920] * 32767).astype(np.int16), 48000, channels=2) == []
    turn = buf.commit()
    expected = resample(mono / 2, 48000, 16000)  # the mean of the channels
    assert abs(len(turn.audio) - len(expected)) <= 16
    n = min(len(turn.audio), len(expected))
    assert np.abs(turn.audio[:n] - expected[:n]).max() < 2e-3
    fields = TurnDetectionFields(
        threshold=0.7, prefix_padding_ms=250, silence_duration_ms=25, create_response=False
    )
    detection = TurnDetection.from_wire(fields)  # times as given, the rest defaults
    assert (detection.vad.threshold, detection.vad.prefix_padding_ms, detection.vad.silence_duration_ms) == (
        0.7,
        250,
        25,
    )
    assert detection.create_response is False and detection.interrupt_response is True


async def test_input_audio_faster_than_real_time_is_limited():
    # Resampling and VAD run on the event loop that serves every connection: a client may send a
    # recording in a burst, but not stream audio at hundreds of times real time.
    peer = PeerSettings(turn_detection=None, max_turn_ms=120_000, max_pending_audio_ms=120_000)
    settings = ServerSettings(port=0, peer=peer)
    async with Server(FakeEngine(step_s=0.0), settings) as server:
        async with websockets.connect(f"ws://127.0.0.1:{server.port}/ws") as ws:
            await recv(ws)
            chunk = pcm16_b64(speech_like(2.0, RATE_IN))
            for i in range(40):  # 80 s of audio, sent in well under a second
                await ws.send(
                    json.dumps({"type": "input_audio_buffer.append", "audio": chunk, "event_id": f"a{i}"})
                )
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            events = await until(ws, "conversation.item.done")
            errors = [e["error"] for e in events if e["type"] == "error"]
            assert errors and {e["code"] for e in errors} == {"rate_limited"}
            await ws.send(json.dumps({"type": "response.create"}))
            await until(ws, "response.done")
            ((turn, rate),) = server.engine.audio_requests
            assert 29 < len(turn) / rate < 40  # the burst (and what came since at 4x), not all 80 s


def test_input_rate_allows_a_burst_then_four_times_real_time():
    from omni_rt.server.speech import InputRate

    now = [0.0]
    rate = InputRate(burst_ms=1000, speed=4.0, clock=lambda: now[0])
    assert rate.take(600) and rate.take(400) and not rate.take(20)
    now[0] += 0.1  # 100 ms later: 400 ms more may come
    assert rate.take(400) and not rate.take(20)
    now[0] += 60.0  # a long pause refills the burst, no more
    assert rate.take(1000) and not rate.take(20)


async def test_a_long_append_is_heard_in_slices_with_the_loop_free_between():
    """A whole clip in one append (as OpenAI's guide sends a file) goes through the detector in 2 s
    slices, the event loop free between them: one 30 s append held every connection's loop ~1 s."""
    from omni_rt.server.conversation import Conversation
    from omni_rt.server.listening import SpeechInput
    from omni_rt.server.protocol import InputAudioBufferAppend
    from omni_rt.server.speech import TurnDetection

    sent: list[dict] = []
    turns: list[int] = []
    speech_input = SpeechInput(
        "t", TurnDetection(), max_turn_ms=30_000, max_pending_ms=60_000, send=sent.append,
        conversation=Conversation(sent.append, 1000), on_speech_started=lambda: None,
        on_turn=lambda: turns.append(1),
    )  # fmt: skip
    clip = np.concatenate([np.zeros(RATE_IN), speech_like(8.0, RATE_IN), np.zeros(RATE_IN)])
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    before = ticks
    await speech_input.append(InputAudioBufferAppend(type="input_audio_buffer.append", audio=pcm16_b64(clip)))
    task.cancel()
    assert ticks - before >= 4  # 10 s in 2 s slices: the loop ran between them
    assert [e["type"] for e in sent if e["type"].startswith("input_audio_buffer")] == [
        "input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped", "input_audio_buffer.committed",
    ]  # fmt: skip
    assert turns == [1]


async def test_a_spoken_turn_under_vad_does_not_take_a_waiting_assistant_message_for_the_users_words():
    """An assistant message item waiting, then a turn that server VAD ends: the reply's text was the
    assistant's words, sent to the model as the user's beside the speech (response.create refuses that
    mix; the VAD's own reply did not ask). It is the same clear error, and the turn waits; once the
    message is deleted, the next turn is answered with the speech alone."""
    engine = FakeEngine(step_s=0.0, reply="ok")
    async with Server(engine, ServerSettings(port=0)) as server:
        async with websockets.connect(f"ws://127.0.0.1:{server.port}/ws") as ws:
            await recv(ws)
            said = {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Welcome back."}],
            }
            await ws.send(json.dumps({"type": "conversation.item.create", "item": said}))
            item = (await until(ws, "conversation.item.done"))[-1]["item"]
            await append(ws, spoken_turn(RATE_IN))
            error = (await until(ws, "error"))[-1]["error"]
            assert error["code"] == "invalid_value" and "assistant" in error["message"]
            assert engine.requests == []
            await ws.send(json.dumps({"type": "conversation.item.delete", "item_id": item["id"]}))
            await until(ws, "conversation.item.deleted")
            await ws.send(json.dumps({"type": "response.create"}))
            assert (await until(ws, "response.done"))[-1]["response"]["status"] == "completed"
            assert engine.requests == [None] and len(engine.audio_requests) == 1
