"""Speculative replies over /ws on the tiny model (CPU): a reply started at a pause that the user then
talks over leaves no trace on the wire or in the conversation, and one released when the turn ends
there is the reply that starting at the end of the turn gives. Compared with the same audio, sent
the same way, with `turn_detection.speculative_response` off (deterministic, greedy, seeded)."""

from __future__ import annotations

import asyncio
import base64
import functools
import json

import numpy as np
import pytest

pytest.importorskip("aiortc")
pytest.importorskip("onnxruntime")

import websockets  # noqa: E402
from audio_clips import needs_espeak, speech  # noqa: E402
from openai_check import validate  # noqa: E402
from server_fakes import speech_like  # noqa: E402

import omni_rt  # noqa: E402
from omni_rt.audio.resample import resample  # noqa: E402
from omni_rt.server import PeerSettings, Server, ServerSettings  # noqa: E402

RATE = 24000


def silence(s: float) -> np.ndarray:
    return np.zeros(int(s * RATE), np.float32)


def b64(audio: np.ndarray) -> str:
    return base64.b64encode((np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()).decode()


async def append(ws, audio: np.ndarray, chunk_ms: int = 20) -> None:
    n = RATE * chunk_ms // 1000
    for i in range(0, len(audio), n):
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(audio[i : i + n])}))


async def recv(ws) -> dict:
    return validate(await asyncio.wait_for(ws.recv(), 60))  # every event, as the SDK's model has it


async def until(ws, type_: str, events: list) -> list[dict]:
    while True:
        events.append(await recv(ws))
        if events[-1]["type"] == type_:
            return events


@pytest.fixture(scope="module")
def engine():
    engine = omni_rt.Engine.load("tiny", deterministic=True)
    # every session the server opens answers greedily with one seed, so two runs can be compared
    engine.session = functools.partial(type(engine).session, engine, sampling=omni_rt.Sampling.greedy(seed=3))
    return engine


async def held_work(peer) -> None:
    """Until the speculative reply has made audio (held back): a wait on the pipeline, not on time."""
    for _ in range(6000):
        current = peer.speculator._current
        spec = current[1] if current is not None else None
        resp = spec._hold.resp if spec is not None else None
        if resp is not None and resp.req.frames > 0:
            return
        await asyncio.sleep(0.005)
    raise AssertionError("no speculative reply was started at the pause")


async def spoken(engine, pieces: list[np.ndarray], speculative: bool, detection: dict | None = None):
    """Send `pieces` (24 kHz); with speculation on, wait after each but the last until a held reply
    has done work. Returns the wire events to the reply's response.done, the session's conversation
    and the peer's speculator."""
    # short replies whose Thinker ends first (its last token fixes the reply's length, whatever the
    # threads' timing), the Talker speaking on to its frame limit
    settings = ServerSettings(port=0, peer=PeerSettings(max_output_tokens=4, max_audio_frames=24))
    async with engine, Server(engine, settings) as server:
        async with websockets.connect(f"ws://127.0.0.1:{server.port}/ws") as ws:
            await recv(ws)
            detection = (detection or {"type": "server_vad"}) | {"speculative_response": speculative}
            await ws.send(json.dumps({"type": "session.update", "session": {"turn_detection": detection}}))
            events: list = []
            await until(ws, "session.updated", events)
            (peer,) = server.peers
            for k, piece in enumerate(pieces):
                await append(ws, piece)
                if speculative and k < len(pieces) - 1:
                    await held_work(peer)
            events = await until(ws, "response.done", [])
            return events, list(peer.session.conversation), peer.speculator


def said(events: list[dict]) -> dict:
    """What the wire said, without ids and timings: the event types in order (deltas of each kind
    counted, their interleaving being the threads'), the transcript, the audio, the outcome."""
    kinds, deltas = [], {}
    for e in events:
        if e["type"].endswith(".delta"):
            deltas[e["type"]] = deltas.get(e["type"], 0) + 1
        else:
            kinds.append(e["type"])
    done = events[-1]["response"]
    return {
        "types": kinds,
        "deltas": deltas,
        "transcript": "".join(
            e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta"
        ),
        "audio": b"".join(
            base64.b64decode(e["delta"]) for e in events if e["type"] == "response.output_audio.delta"
        ),
        "done": (done["status"], done["usage"]["output_tokens"]),
        "stopped": [e["audio_end_ms"] for e in events if e["type"] == "input_audio_buffer.speech_stopped"],
    }


async def test_a_speculative_reply_talked_over_leaves_no_trace(engine):
    # a 300 ms pause (a reply starts at 160 ms of it; server_vad's window is 500 ms), then more speech
    pieces = [
        np.concatenate([silence(0.3), speech_like(0.8, RATE, seed=1), silence(0.3)]),
        np.concatenate([speech_like(0.6, RATE, seed=2), silence(1.0)]),
    ]
    off, off_conv, _ = await spoken(engine, pieces, speculative=False)
    on, on_conv, spec = await spoken(engine, pieces, speculative=True)
    assert spec.started == 1 and spec.dropped == 1 and spec.released == 0
    assert said(on) == said(off) and said(off)["done"][0] in ("completed", "incomplete")
    assert on.count("response.created") == off.count("response.created")
    assert on_conv == off_conv and off_conv


async def test_a_released_speculative_reply_is_the_reply_started_at_the_end(engine):
    pieces = [np.concatenate([silence(0.3), speech_like(0.8, RATE, seed=4), silence(0.3)]), silence(1.0)]
    off, off_conv, _ = await spoken(engine, pieces, speculative=False)
    on, on_conv, spec = await spoken(engine, pieces, speculative=True)
    assert spec.started == 1 and spec.released == 1 and spec.dropped == 0
    assert said(on) == said(off)
    assert on_conv == off_conv and off_conv
    metrics = on[-1]["response"]["metrics"]
    assert metrics["held_ms"] > 0 and metrics["voice_to_voice_ms"] > 0
    assert off[-1]["response"]["metrics"]["held_ms"] is None


@needs_espeak
async def test_semantic_vad_with_a_speculative_start_answers_as_without(engine):
    # Smart Turn hears a finished question: the turn ends at the model's answer, after the reply was
    # started at the pause (the same 160 ms, where the model is asked); whether the answer or the held
    # reply comes first, what the wire says is what it says with speculation off.
    voice = resample(speech("What is the capital of France?"), 16000, RATE)
    pieces = [np.concatenate([silence(0.3), voice, silence(2.5)])]
    semantic = {"type": "semantic_vad", "eagerness": "auto"}
    off, off_conv, _ = await spoken(engine, pieces, speculative=False, detection=semantic)
    on, on_conv, spec = await spoken(engine, pieces, speculative=True, detection=semantic)
    # (where the turn ends on the audio timeline is when the model's answer came: the model hears the
    # turn up to 160 ms after the voice either way)
    (on_said, on_stop), (off_said, off_stop) = (split(said(x)) for x in (on, off))
    assert on_said == off_said and len(on_stop) == len(off_stop) == 1
    assert on_conv == off_conv and off_conv
    assert spec.started == 1 and spec.released + spec.dropped == 1


def split(d: dict) -> tuple[dict, list]:
    return {k: v for k, v in d.items() if k != "stopped"}, d["stopped"]
