"""A scripted stand-in for `omni_rt.Engine` with the public Session API, for fast server tests.

It yields the SDK's own event classes in the order a Session does (created, text and transcript deltas,
80 ms sine chunks at 24 kHz, audio done, response.done with metrics), paced by a per-word delay, and
keeps count of open sessions, running responses and model steps so tests can prove that a vanished
client stops the work it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools

import numpy as np

from omni_rt.errors import CapacityError, InvalidRequestError
from omni_rt.events import (
    Metrics,
    ResponseCreated,
    ResponseDone,
    ResponseOutputAudioDelta,
    ResponseOutputAudioDone,
    ResponseOutputAudioTranscriptDelta,
    ResponseOutputTextDelta,
    Usage,
)

RATE = 24000
FRAME = RATE * 80 // 1000  # one codec frame: 80 ms
VOICES = ("ethan", "chelsie")


class FakeSession:
    def __init__(self, engine: FakeEngine, voice: str, instructions: str | None, output_sample_rate: int):
        self.engine = engine
        self.voice = voice
        self.instructions = instructions
        self.rate = output_sample_rate
        self._cancel = asyncio.Event()
        self.pcm_samples: dict[str, int] = {}  # response id → samples yielded

    async def respond(self, text: str, *, max_output_tokens: int = 256, **_: object):
        rid = f"resp_{next(self.engine.ids)}"
        self._cancel.clear()
        self.engine.running += 1
        self.engine.requests.append(text)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        ttft = ttfa = None
        status = "completed"
        try:
            yield ResponseCreated(response_id=rid)
            words = (self.engine.reply or f"you said {text}").split()[:max_output_tokens]
            phase = 0
            for i, word in enumerate(words):
                if self._cancel.is_set():
                    status = "cancelled"
                    break
                await asyncio.sleep(self.engine.step_s)
                self.engine.steps += 1
                delta = word if i == 0 else " " + word
                ttft = ttft if ttft is not None else 1000 * (loop.time() - t0)
                yield ResponseOutputTextDelta(response_id=rid, delta=delta, token_ids=[i])
                yield ResponseOutputAudioTranscriptDelta(response_id=rid, delta=delta)
                n = FRAME * self.engine.frames_per_word
                t = (phase + np.arange(n)) / RATE
                phase += n
                pcm = (6000 * np.sin(2 * np.pi * 330 * t)).astype(np.int16)
                ttfa = ttfa if ttfa is not None else 1000 * (loop.time() - t0)
                self.pcm_samples[rid] = self.pcm_samples.get(rid, 0) + n
                yield ResponseOutputAudioDelta(
                    response_id=rid,
                    pcm=pcm,
                    sample_rate=RATE,
                    frame_index=i,
                    num_frames=self.engine.frames_per_word,
                )
            if status == "completed":
                yield ResponseOutputAudioDone(response_id=rid)
            yield ResponseDone(
                response_id=rid,
                status=status,
                usage=Usage(output_tokens=len(words)),
                metrics=Metrics(ttft_ms=ttft, ttfa_ms=ttfa, total_ms=1000 * (loop.time() - t0)),
            )
        finally:
            self.engine.running -= 1

    async def cancel(self) -> None:
        self._cancel.set()


class FakeEngine:
    def __init__(
        self, *, step_s: float = 0.02, frames_per_word: int = 1, reply: str | None = None, max_sessions=8
    ):
        self.step_s = step_s
        self.frames_per_word = frames_per_word
        self.reply = reply
        self.max_sessions = max_sessions
        self.ids = itertools.count(1)
        self.open_sessions = 0
        self.running = 0  # responses whose generator is still alive
        self.steps = 0  # "model steps" taken, to see work stop
        self.requests: list[str] = []
        self.sessions: list[FakeSession] = []

    @contextlib.asynccontextmanager
    async def session(
        self, *, voice: str = "ethan", instructions: str | None = None, output_sample_rate: int = RATE
    ):
        if voice not in VOICES:
            raise InvalidRequestError(f"unknown voice {voice!r}; known: {', '.join(VOICES)}")
        if self.open_sessions >= self.max_sessions:
            raise CapacityError("no free session slot")
        self.open_sessions += 1
        s = FakeSession(self, voice, instructions, output_sample_rate)
        self.sessions.append(s)
        try:
            yield s
        finally:
            await s.cancel()
            self.open_sessions -= 1
