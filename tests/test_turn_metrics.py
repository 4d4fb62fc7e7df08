"""Replies to spoken turns report end_of_speech_ms and voice_to_voice_ms, counted from where the voice
ended (not from the request, not from speech_stopped), with server_vad and semantic_vad."""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import pytest

pytest.importorskip("aiortc")
pytest.importorskip("onnxruntime")

import websockets  # noqa: E402
from audio_clips import SR, cat, needs_espeak, silence, speech  # noqa: E402
from server_fakes import FakeEngine  # noqa: E402

from omni_rt.audio.resample import resample  # noqa: E402
from omni_rt.audio.vad import Turn  # noqa: E402
from omni_rt.server import Server, ServerSettings  # noqa: E402
from omni_rt.server.turns import ArrivalLog, SpokenTurnClock  # noqa: E402

RATE_IN = 24000


def test_the_clock_dates_the_end_of_speech_by_its_arrival():
    log = ArrivalLog()
    for i in range(1, 101):  # 20 ms pieces, in real time from t = 10 s
        log.note(20.0 * i, 10.0 + 0.02 * i)
    turn = Turn(audio=np.zeros(0, np.float32), audio_start_ms=0, audio_end_ms=1600, speech_end_ms=1100)
    clock = SpokenTurnClock.from_turn(turn, log)
    assert clock is not None and clock.speech_end_at == pytest.approx(10.0 + 0.02 * 55)
    assert clock.metrics() == {"end_of_speech_ms": 1100}  # no audio out yet: no voice-to-voice figure
    clock.audio_out(11.9)
    clock.audio_out(12.5)  # only the first audio counts
    assert clock.metrics() == {"end_of_speech_ms": 1100, "voice_to_voice_ms": pytest.approx(800.0)}
    committed = Turn(audio=np.zeros(0, np.float32), audio_start_ms=0, audio_end_ms=1600)
    assert SpokenTurnClock.from_turn(committed, log) is None  # a manual commit: no end of speech known


def b64(audio: np.ndarray) -> str:
    return base64.b64encode((np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()).decode()


async def until(ws, type_: str) -> list[dict]:
    events = []
    while True:
        events.append(json.loads(await asyncio.wait_for(ws.recv(), 30)))
        if events[-1]["type"] == type_:
            return events


@needs_espeak
@pytest.mark.parametrize("detection", ["server_vad", "semantic_vad"])
async def test_a_spoken_turn_reply_reports_end_of_speech_and_voice_to_voice(detection):
    voice = speech("What is the capital of France?")
    end_ms = 500 + len(voice) * 1000 // SR
    clip = resample(cat(silence(500), voice, silence(1500)), SR, RATE_IN)
    engine = FakeEngine(step_s=0.0, reply="Paris")
    async with Server(engine, ServerSettings(port=0)) as server:
        async with websockets.connect(f"ws://127.0.0.1:{server.port}/ws") as ws:
            await until(ws, "session.created")
            update = {"audio": {"input": {"turn_detection": {"type": detection}}}}
            await ws.send(json.dumps({"type": "session.update", "session": update}))
            await until(ws, "session.updated")
            step = RATE_IN // 10
            for i in range(0, len(clip), step):  # 100 ms pieces at once: the clock must not assume pacing
                await ws.send(
                    json.dumps({"type": "input_audio_buffer.append", "audio": b64(clip[i : i + step])})
                )
            events = await until(ws, "response.done")
            stopped = next(e for e in events if e["type"] == "input_audio_buffer.speech_stopped")
            metrics = events[-1]["response"]["metrics"]
            # where the voice ended on the buffer's timeline, before the silence window / the model's wait
            assert end_ms - 32 <= metrics["end_of_speech_ms"] <= end_ms + 6 * 32
            assert metrics["end_of_speech_ms"] < stopped["audio_end_ms"]
            assert 0 < metrics["voice_to_voice_ms"] < 20_000

            # a text turn's reply has neither figure
            await ws.send(
                json.dumps(
                    {
                        "type": "conversation.item.create",
                        "item": {
                            "type": "message",
                            "role": "user",
                            "content": [{"type": "input_text", "text": "hi"}],
                        },
                    }
                )
            )
            await ws.send(json.dumps({"type": "response.create"}))
            events = await until(ws, "response.done")
            metrics = events[-1]["response"].get("metrics") or {}
            assert "end_of_speech_ms" not in metrics and "voice_to_voice_ms" not in metrics


@needs_espeak
async def test_semantic_vad_ends_a_turn_when_its_model_answers_with_no_more_audio_coming():
    # The end-of-turn model runs on a worker thread (the event loop never waits for it); the client
    # sends its question and 400 ms of silence, then nothing: the model's answer alone ends the turn.
    voice = speech("What is the capital of France?")
    clip = resample(cat(silence(300), voice, silence(400)), SR, RATE_IN)
    engine = FakeEngine(step_s=0.0, reply="Paris")
    async with Server(engine, ServerSettings(port=0)) as server:
        async with websockets.connect(f"ws://127.0.0.1:{server.port}/ws") as ws:
            await until(ws, "session.created")
            update = {"audio": {"input": {"turn_detection": {"type": "semantic_vad", "eagerness": "low"}}}}
            await ws.send(json.dumps({"type": "session.update", "session": update}))
            await until(ws, "session.updated")
            half = len(clip) // 2  # an append holds at most 2 s
            for part in (clip[:half], clip[half:]):
                await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(part)}))
            events = await until(ws, "response.done")
            stopped = next(e for e in events if e["type"] == "input_audio_buffer.speech_stopped")
            assert stopped["audio_end_ms"] <= 300 + len(voice) * 1000 // SR + 400  # within what was sent
            assert events[-1]["response"]["status"] == "completed"
