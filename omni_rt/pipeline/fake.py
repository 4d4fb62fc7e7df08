"""Fake stage runners with scripted durations, for policy tests and the scheduler's benchmark rows.

No torch. Outputs are deterministic functions of the request's prompt and position, so a request gets
the same tokens, codes and PCM however the scheduler batches it. Work is simulated with `time.sleep`
inside the stage call (the stage is busy, as a GPU kernel would keep it); the scheduler itself never
sleeps.
"""

from __future__ import annotations

import threading
import time
import zlib
from dataclasses import dataclass

import numpy as np

from omni_rt.model.config import TokenIds
from omni_rt.pipeline.request import Request


@dataclass
class FakeTimings:
    """Seconds per call. Batched calls take the same time as single ones (decode is bandwidth-bound)."""

    thinker_prefill: float = 0.020
    thinker_prefill_token: float = 0.0  # more per prompt token prefilled (a long prompt's cost)
    thinker_decode: float = 0.010
    talker_prefix: float = 0.005
    talker_last: float = 0.003
    talker_step: float = 0.002
    predict: float = 0.002
    code2wav_chunk: float = 0.001


def _h(*xs: int) -> int:
    return zlib.crc32(np.asarray(xs, dtype=np.int64).tobytes())


class _Busy:
    """Simulated work; `fail_on` makes the named call raise (stage-crash tests)."""

    def __init__(self, timings: FakeTimings, fail_on: set[str] | None = None) -> None:
        self.t = timings
        self.fail_on = fail_on or set()
        self.calls: dict[str, int] = {}
        self._lock = threading.Lock()

    def work(self, kind: str, seconds: float, reqs: list[Request]) -> None:
        with self._lock:
            self.calls[kind] = self.calls.get(kind, 0) + 1
        if kind in self.fail_on or any(f"{kind}:{r.id}" in self.fail_on for r in reqs):
            raise RuntimeError(f"scripted failure in {kind}")
        if seconds > 0:
            time.sleep(seconds)


class FakeThinker(_Busy):
    """Tokens are a hash of (prompt, index); `<|im_end|>` after `reply_len` tokens."""

    def __init__(self, timings: FakeTimings, ids: TokenIds, reply_len: int = 8, **kw) -> None:
        super().__init__(timings, **kw)
        self.ids = ids
        self.reply_len = reply_len

    def _token(self, req: Request, i: int) -> int:
        if i >= self.reply_len - 1:
            return self.ids.im_end
        return 33 + _h(*req.prompt_ids, i) % 90  # ids that the tiny byte-level tokenizer prints

    def prefill(self, reqs: list[Request], queued=None) -> list[int]:
        if queued is not None:  # enqueued: the work below is the device's, the host then waits for it
            queued(reqs, None)
        tokens = max(len(r.pending_prompt_ids) for r in reqs)
        self.work("prefill", self.t.thinker_prefill + self.t.thinker_prefill_token * tokens, reqs)
        return [self._token(r, 0) for r in reqs]

    def prefill_piece(self, req: Request, n: int) -> None:
        self.work("piece", self.t.thinker_prefill_token * n, [req])
        req.prefilled += n

    def decode(self, reqs: list[Request]) -> list[int]:
        self.work("decode", self.t.thinker_decode, reqs)
        return [self._token(r, len(r.tokens)) for r in reqs]


class FakeTalker(_Busy):
    """Code 0 of frame f is a hash of (prompt, f, text id read); codec EOS `frames_after_text` frames
    after the text ends."""

    def __init__(self, timings: FakeTimings, ids: TokenIds, frames_after_text: int = 2, **kw) -> None:
        super().__init__(timings, **kw)
        self.ids = ids
        self.frames_after_text = frames_after_text
        self._frames: dict[int, int] = {}  # slot -> code 0s sampled
        self._pads: dict[int, int] = {}  # slot -> tts_pad steps read

    def prefill_prefix(self, reqs: list[Request]) -> None:
        self.work("prefix", self.t.talker_prefix, reqs)
        for r in reqs:
            self._frames[r.slot] = 0
            self._pads[r.slot] = 0

    def _code0(self, req: Request, text_id: int) -> int:
        f = self._frames[req.slot]
        self._frames[req.slot] = f + 1
        if text_id == self.ids.tts_pad:
            self._pads[req.slot] += 1
            if self._pads[req.slot] >= self.frames_after_text:
                return self.ids.codec_eos
        return _h(*req.prompt_ids, f, text_id) % 2048

    def queue_last(self, reqs: list[Request], ready: object) -> object:
        self.work("queue", 0.0, reqs)  # `prefill_last` does the work here (its outputs are the same)
        return None

    def prefill_last(self, reqs: list[Request], first_tokens: list[int]) -> list[int]:
        self.work("last", self.t.talker_last, reqs)
        return [self._code0(r, t) for r, t in zip(reqs, first_tokens, strict=True)]

    def predict(self, reqs: list[Request], code0: list[int]) -> list[list[int]]:
        self.work("predict", self.t.predict, reqs)
        return [[c] + [_h(c, g) % 2048 for g in range(1, 16)] for c in code0]

    def step(self, reqs: list[Request], frames: list[list[int]], text_ids: list[int]) -> list[int]:
        self.work("step", self.t.talker_step, reqs)
        return [self._code0(r, t) for r, t in zip(reqs, text_ids, strict=True)]


class FakeCode2Wav(_Busy):
    """PCM of a frame: 1920 samples derived from its code 0; exact-streaming shape (first chunk short)."""

    samples_per_frame = 1920
    shortfall = 555

    def __init__(self, timings: FakeTimings, **kw) -> None:
        super().__init__(timings, **kw)
        self._emitted: dict[int, int] = {}

    def open(self, req: Request) -> None:
        self._emitted[req.slot] = 0

    def queue_first(self, req: Request, ready: object) -> None:
        self.work("queue", 0.0, [req])  # `push` does the work here (its PCM is the same)
        self.open(req)

    def push(self, req: Request, frames: list[list[int]]) -> np.ndarray:
        self.work("chunk", self.t.code2wav_chunk, [req])
        return self._pcm(req, frames)

    def _pcm(self, req: Request, frames: list[list[int]]) -> np.ndarray:
        pcm = np.concatenate(
            [np.full(self.samples_per_frame, (f[0] % 200 - 100) / 200, np.float32) for f in frames]
        )
        if self._emitted[req.slot] == 0:
            pcm = pcm[self.shortfall :]
        self._emitted[req.slot] += len(pcm)
        return pcm

    def push_many(self, reqs: list[Request], frames: list[list[list[int]]]) -> list[np.ndarray]:
        if len(reqs) == 1:  # as the real runner: one request is its `push`
            return [self.push(reqs[0], frames[0])]
        self.work("chunk", self.t.code2wav_chunk, reqs)  # one call's time, as a batched kernel's
        return [self._pcm(r, f) for r, f in zip(reqs, frames, strict=True)]

    def flush(self, req: Request) -> np.ndarray:
        return np.zeros(0, np.float32)

    def close(self, req: Request) -> None:
        self._emitted.pop(req.slot, None)
