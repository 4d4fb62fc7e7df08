"""The Code2Wav thread of the scheduler: each response's frames in, exact streaming PCM out, in chunks.

Plain Python, as the rest of the scheduler (`scheduler.py` wires this loop to its inbox and shares its
helpers: posting to the session, failing and releasing a request, the step log). Chunks follow the
planned sizes (1, 2, 4, ... frames as `EngineSettings.chunk_size` plans them), or go early when the audio would run
dry first (`pacing.chunk_to_decode`); at the end, the remainder. Which chunks a call decodes:
`chunk_batch`. A request's end (`AudioDoneOut`) comes after its last PCM, and only if nothing stopped it
meanwhile.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from omni_rt.pipeline.handoff import AudioEnd, Frame, FrameQueued, Handoff
from omni_rt.pipeline.pacing import audio_urgency, chunk_to_decode, chunk_wait_until
from omni_rt.pipeline.request import AudioDoneOut, AudioOut, Request

if TYPE_CHECKING:
    from omni_rt.pipeline.scheduler import Pipeline


def chunk_batch(
    ready: list[tuple[AudioSeq, int]], batched: bool, ragged: bool = True
) -> list[tuple[AudioSeq, int]]:
    """The responses one Code2Wav call decodes, each with its frames, from (response, frames due).

    The response whose audio runs dry first (`pacing.audio_urgency`), its chunk as due: with many
    conversations a new one's first chunk, or one about to run dry, never waits behind the chunks of those
    that are ahead. With `code2wav_batch`, every other response with a chunk due that is no longer rides
    along with its own chunk (ragged: each row padded to the longest, `Code2WavState.valid`; without
    `ragged`, only chunks of the same size); one call
    costs little more than one row (on an H200 a 1-frame chunk of 1 row takes 1.58 ms, of 16 rows 2.45 ms;
    a row's 16 frames ~0.06 ms a frame).

    Longer chunks than the most urgent one's wait for a call of their own size: cut to its size (measured
    at 64 conversations, 2026-12-03, docs/performance.md), they were cut to 1 frame whenever a conversation
    started, and each cut response then waited for its next call; more replies ran late for longer
    (lateness p50 472 ms against 257-297 ms)."""
    a, n = min(ready, key=lambda an: audio_urgency(an[0].req, an[0].t_first_frame or 0.0))
    if not batched:
        return [(a, n)]
    return [(a, n)] + [(b, m) for b, m in ready if (m <= n if ragged else m == n) and b is not a]


RECENT_FRAMES = 8  # the frame interval that early chunks count on: over this many latest frames


@dataclass(eq=False)
class AudioSeq:
    """One response's Code2Wav state."""

    req: Request
    pending: list[list[int]] = field(default_factory=list)
    next_frame: int = 0  # index of pending[0] in the response
    opened: bool = False
    ended: bool = False
    t_first_frame: float | None = None  # arrival of frame 0 (pipeline clock)
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_FRAMES + 1))  # latest arrivals

    def frame_arrived(self, t: float) -> None:
        if self.t_first_frame is None:
            self.t_first_frame = t
        self.recent.append(t)

    def frame_interval(self) -> float | None:
        """Mean seconds between this response's latest frames (up to RECENT_FRAMES intervals); None
        before its second frame. Not the mean since frame 0: a reply's first frames come fast (the Talker
        runs few rows), and as conversations join they slow down; at 64 conversations on an H200 from
        ~30 to ~57 ms, and a mean since frame 0 (40 ms) let early chunks wait for frames that came too
        late (2026-12-04, docs/performance.md)."""
        if len(self.recent) < 2:
            return None
        return (self.recent[-1] - self.recent[0]) / (len(self.recent) - 1)


class Code2WavLoop:
    """The Code2Wav stage thread's loop (`loop`), over the pipeline's Code2Wav stage and inbox."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.p = pipeline

    def loop(self) -> None:
        # all its work arrives as messages: sleep only while no response has a chunk to decode
        self.p._serve(
            "code2wav", self.p.code2wav_inbox, lambda seqs: any(self._ready(a) for a in seqs.values()),
            self._iteration, self._close, self._wake_at,
        )  # fmt: skip

    def _iteration(self, msgs: list[Handoff], seqs: dict[Request, AudioSeq]) -> None:
        """Take the messages, then decode one chunk: the most urgent response's (`pacing.audio_urgency`).
        One chunk per iteration, so frames that arrive while it decodes are read before the next choice."""
        for m in msgs:
            req = m.req
            if "code2wav" not in req.holders:
                continue
            a = seqs.get(req)
            if a is None:
                a = seqs[req] = AudioSeq(req)
            if isinstance(m, FrameQueued):
                self._queue_first(a, m.ready, seqs)
            elif isinstance(m, Frame):
                a.pending.append(m.codes)
                a.frame_arrived(self.p.clock())
            elif isinstance(m, AudioEnd):
                a.ended = True
        for a in list(seqs.values()):
            if a.req.stopped:
                self._close(a, seqs)
            elif a.ended and not a.pending:  # a response that ended with no frame, or after its last chunk
                self._finish(a, seqs)
        ready = [(a, n) for a in seqs.values() if (n := self._chunk_now(a))]
        if not ready:
            return
        chosen = chunk_batch(ready, self.p.settings.code2wav_batched, self.p.settings.code2wav_ragged)
        frames = {a: n for a, n in chosen}
        batch = [a for a, _ in chosen]
        _, failed = self.p._shared_call(batch, lambda b: self._decode_chunks(b, [frames[a] for a in b]))
        for b, err in failed:
            self.p._fail(b.req, self.p._stage_error("code2wav", "decode", err))
            self._close(b, seqs)
        for b in [b for b in batch if b.req in seqs]:
            if b.req.stopped:  # while its chunk decoded: the chunk was dropped, and so is the end
                self._close(b, seqs)
            elif b.ended and not b.pending:
                self._finish(b, seqs)

    def _queue_first(self, a: AudioSeq, ready: object, seqs: dict[Request, AudioSeq]) -> None:
        """`early_start`: decode the response's frame 0, on the device behind the Talker's, before it is
        here. Only while no other response is here: the stream waits for the Talker, and another's chunk
        would wait with it. Otherwise its frame 0 decodes when it comes, as without `early_start`."""
        if len(seqs) > 1 or a.opened or a.pending or a.req.stopped:
            return
        t0 = self.p.clock()
        try:
            self.p.code2wav.queue_first(a.req, ready)
        except Exception as e:
            self.p._fail(a.req, self.p._stage_error("code2wav", "decode", e))
            self._close(a, seqs)
            return
        a.opened = True
        self.p._record("code2wav", "queue", t0, [a.req])

    def _ready(self, a: AudioSeq) -> bool:
        """Has `a` work now: a chunk to decode, an end to send, or a stop to act on?"""
        return a.req.stopped or (a.ended and not a.pending) or self._chunk_now(a)

    def _wake_at(self, seqs: dict[Request, AudioSeq]) -> float | None:
        """The earliest time (pipeline clock) a response's early chunk comes due without a frame coming."""
        s = self.p.settings
        times = [
            t for a in seqs.values() if a.pending and not a.req.stopped
            if (t := chunk_wait_until(len(a.pending), a.next_frame, a.ended, a.req, a.frame_interval(), s)) is not None
        ]  # fmt: skip
        return min(times, default=None)

    def _chunk_now(self, a: AudioSeq) -> int:
        """Frames of `a` to decode now (0: none): a planned size (1, 2, 4, ...), a smaller one early when
        the audio would run dry first (`pacing.chunk_to_decode`), at the end the remainder."""
        if not a.pending or a.req.stopped:
            return 0
        return chunk_to_decode(
            len(a.pending), a.next_frame, a.ended, a.req, a.frame_interval(), self.p.clock(), self.p.settings
        )

    def _decode_chunks(self, batch: list[AudioSeq], sizes: list[int]) -> list[None]:
        """The next sizes[i] frames of each response batch[i], in one stage call, then each one's PCM out.
        A failed call keeps nothing (its frames stay queued), so it can be made again."""
        chunks = [a.pending[:n] for a, n in zip(batch, sizes, strict=True)]
        for a in batch:
            if not a.opened:
                self.p.code2wav.open(a.req)
                a.opened = True
        t0 = self.p.clock()
        pcms = self.p.code2wav.push_many([a.req for a in batch], chunks)
        for a, n in zip(batch, sizes, strict=True):  # decoded: the frames leave the queue (a failed call
            a.pending = a.pending[n:]  # leaves them, for a retry)
        for k, a in enumerate(batch):
            if a.ended and not a.pending:
                tail = self.p.code2wav.flush(a.req)
                if len(tail):
                    pcms[k] = np.concatenate([pcms[k], tail])
        self.p._record("code2wav", "chunk", t0, [a.req for a in batch])
        for a, pcm, n in zip(batch, pcms, sizes, strict=True):
            self._post_pcm(a, pcm, n)
        return [None] * len(batch)

    def _post_pcm(self, a: AudioSeq, pcm: np.ndarray, n: int) -> None:
        if a.req.stopped:
            return  # cancelled while decoding: drop the chunk
        first = a.req.t_first_pcm is None
        if first:
            a.req.t_first_pcm = self.p.clock()
        a.req.samples += len(pcm)
        self.p._post(a.req, AudioOut(pcm, a.next_frame, n))
        if first:
            self.p._clear_frame0(a.req)  # wakes a Thinker yielding until the first audio (yield_until)
        a.next_frame += n

    def _finish(self, a: AudioSeq, seqs: dict[Request, AudioSeq]) -> None:
        self.p._post(a.req, AudioDoneOut())
        self._close(a, seqs)

    def _close(self, a: AudioSeq, seqs: dict[Request, AudioSeq]) -> None:
        seqs.pop(a.req, None)
        if a.opened:
            try:
                self.p.code2wav.close(a.req)
            except Exception as e:
                self.p._fail(a.req, self.p._stage_error("code2wav", "close", e))
        self.p._release(a.req, "code2wav")
