"""Input audio transcription: every spoken item gets its transcript from the engine (delta, then
completed), never before the reply's first audio; a transcription that cannot run fails with a reason."""

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
from omni_rt.server import Server, ServerSettings  # noqa: E402

RATE_IN = 24000
T = "conversation.item.input_audio_transcription"


def b64(audio: np.ndarray) -> str:
    return base64.b64encode((np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()).decode()


async def recv(ws) -> dict:
    return json.loads(await asyncio.wait_for(ws.recv(), 30))


async def until(ws, *types: str) -> list[dict]:
    events = []
    while not events or events[-1]["type"] not in types:
        events.append(await recv(ws))
    return events


async def say(ws, text: str) -> None:
    clip = resample(cat(silence(400), speech(text), silence(1200)), SR, RATE_IN)
    step = RATE_IN // 10
    for i in range(0, len(clip), step):
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(clip[i : i + step])}))


async def update(ws, transcription) -> dict:
    session = {"audio": {"input": {"transcription": transcription}}}
    await ws.send(json.dumps({"type": "session.update", "session": session}))
    return (await until(ws, "session.updated", "error"))[-1]


@needs_espeak
async def test_spoken_items_get_their_transcript_after_the_reply_starts():
    engine = FakeEngine(step_s=0.01, reply="Paris is the capital")
    async with Server(engine, ServerSettings(port=0)) as server:
        async with websockets.connect(f"ws://127.0.0.1:{server.port}/ws") as ws:
            await recv(ws)
            updated = await update(ws, {"model": "omni_rt"})
            assert updated["session"]["audio"]["input"]["transcription"] == {"model": "omni_rt"}
            await say(ws, "What is the capital of France?")
            events = await until(ws, f"{T}.completed", f"{T}.failed")
            types = [e["type"] for e in events]
            committed = next(e for e in events if e["type"] == "input_audio_buffer.committed")
            completed = events[-1]
            assert completed["type"] == f"{T}.completed", completed
            assert completed["item_id"] == committed["item_id"] and completed["content_index"] == 0
            deltas = [e["delta"] for e in events if e["type"] == f"{T}.delta"]
            assert deltas and "".join(deltas).strip() == completed["transcript"] == "Paris is the capital"
            # the engine heard the turn's audio with the transcription instruction, in its own request
            assert len(engine.audio_requests) == 2 and engine.requests[1].startswith("Transcribe")
            # the reply's first audio went out before the transcription started
            assert types.index("response.output_audio.delta") < types.index(f"{T}.delta")


@needs_espeak
async def test_no_free_session_slot_is_a_failed_transcription_and_off_means_none():
    engine = FakeEngine(step_s=0.0, reply="ok", max_sessions=1)  # the connection's own session takes it
    async with Server(engine, ServerSettings(port=0)) as server:
        async with websockets.connect(f"ws://127.0.0.1:{server.port}/ws") as ws:
            await recv(ws)
            await update(ws, {"model": "omni_rt"})
            await say(ws, "Hello there.")
            events = await until(ws, f"{T}.completed", f"{T}.failed")
            failed = events[-1]
            assert failed["type"] == f"{T}.failed"
            assert failed["error"]["code"] == "session_limit" and failed["error"]["message"]
            if not any(e["type"] == "response.done" for e in events):
                await until(ws, "response.done")  # the reply itself was not affected

            assert "transcription" not in (await update(ws, None))["session"]["audio"]["input"]
            await say(ws, "Hello again.")
            events = await until(ws, "response.done")
            assert not any(e["type"].startswith(T) for e in events)
            bad = await update(ws, "whisper-1")
            assert bad["type"] == "error" and bad["error"]["code"] == "invalid_value"
