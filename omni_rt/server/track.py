"""The outgoing audio track: a session's PCM, paced as 20 ms frames at 48 kHz, for aiortc to send.

aiortc's sender calls `recv()` in a tight loop and never waits, so the track paces itself: frame `n`
is returned at `anchor + n * 20 ms` on the monotonic clock. After a stall (no audio to send, or a late
caller) the anchor moves forward instead of the frames going out as a burst; `pts` stays contiguous,
so the receiver sees one unbroken stream.

The buffer in front of `recv()` is small (about 100 ms) so that a barge-in drops almost nothing that
is already committed to the wire; writers wait for room. With `start_lead_ms`, a response's first frame
waits until that much of it is buffered (or all of it has come): a pipeline that makes audio barely
faster than real time (a small CPU) then starts with a margin instead of running dry between its first
chunks. Opus in aiortc always encodes 48 kHz, so audio at any other rate is resampled here once,
streaming, a packet's worth at a time just before it is buffered (so no long chunk holds the event loop).
"""

from __future__ import annotations

import asyncio
import fractions
import time
from collections.abc import Callable
from typing import Literal

import av
import numpy as np
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from omni_rt.audio.resample import StreamingResampler

SAMPLE_RATE = 48_000
FRAME_SAMPLES = 960  # 20 ms at 48 kHz: what aiortc's Opus encoder consumes per packet
TIME_BASE = fractions.Fraction(1, SAMPLE_RATE)

Idle = Literal["nothing", "silence"]


class StreamResampler:
    """int16 in, int16 out around the SDK's streaming resampler (`omni_rt.audio.resample`).

    A response is resampled as one stream: `push()` each chunk, `flush()` at its end for the filter's
    look-ahead. Make a new one per response (or after a cancel) so no old state leaks into new audio.
    """

    def __init__(self, in_rate: int, out_rate: int = SAMPLE_RATE) -> None:
        self._resampler = StreamingResampler(in_rate, out_rate)

    def push(self, pcm: np.ndarray) -> np.ndarray:
        return _to_int16(self._resampler.push(pcm.astype(np.float32)))

    def flush(self) -> np.ndarray:
        return _to_int16(self._resampler.flush())


def _to_int16(x: np.ndarray) -> np.ndarray:
    # The filter overshoots slightly near full scale: clip rather than wrap around.
    return np.clip(np.rint(x), -32768, 32767).astype(np.int16)


def _make_resampler(in_rate: int) -> StreamResampler | None:
    return None if in_rate == SAMPLE_RATE else StreamResampler(in_rate)


class AudioOutputTrack(MediaStreamTrack):
    """One outgoing mono audio track. Feed it with `write()`; end each response with `end_response()`.

    `idle="silence"` keeps a continuous stream of silent frames between replies (what the server
    uses). `idle="nothing"` sends no packets then: the first reply is heard ~40 ms sooner, but `pts` runs
    on across the gap, so Chromium's jitter buffer (NetEq) counts a gap of under ~3 s as network delay
    and raises its target by about that much (measured: the third of replies 1.2 s apart was heard
    ~0.7 s late; `tests/test_browser.py`). Advancing `pts` over the gap instead makes NetEq conceal the
    gap as loss, which is worse. Without DTX (aiortc has none) silence is what keeps playout prompt.

    `start_lead_ms`: audio of a response buffered before its first frame goes out (0: at once). The
    frames before it are silence (`idle="silence"`) or nothing, as between replies.

    `on_started(response_id)` is called when the first frame of a response goes out and
    `on_stopped(response_id)` when its last frame has gone out. They run inside `recv()`, so they must
    not block: send a message, set a flag.
    """

    kind = "audio"

    def __init__(
        self,
        *,
        idle: Idle = "nothing",
        max_buffer_ms: int = 100,
        start_lead_ms: int = 0,
        on_started: Callable[[str], None] | None = None,
        on_stopped: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        if idle not in ("nothing", "silence"):
            raise ValueError(f"idle must be 'nothing' or 'silence', not {idle!r}")
        self.idle = idle
        if start_lead_ms < 0:
            raise ValueError(f"start_lead_ms must be at least 0, not {start_lead_ms}")
        # A response starts once this much of it is buffered: at least a frame.
        self.start_lead_samples = max(FRAME_SAMPLES, start_lead_ms * SAMPLE_RATE // 1000)
        # The lead must fit, or a writer could wait for room that never comes.
        self.max_buffer_samples = max(self.start_lead_samples, max_buffer_ms * SAMPLE_RATE // 1000)
        self._on_started = on_started
        self._on_stopped = on_stopped
        self._clock = clock

        self._buffer = np.zeros(0, dtype=np.int16)  # 48 kHz samples not yet sent
        self._has_data = asyncio.Event()  # set while recv() has something to do
        self._has_room = asyncio.Event()
        self._has_room.set()
        self._resampler: StreamResampler | None = None
        self._resampler_rate = 0
        self._response_id: str | None = None  # the response whose audio is buffered or arriving
        self._response_started = False  # its first frame has gone out
        self.response_frames = 0  # frames of the current response sent so far (what was played)
        self._response_ending = False  # end_response() was called: pad and finish when drained

        self._pts = 0
        self._anchor: float | None = None  # clock time of pts 0; moved forward after stalls

        # Counters for tests and metrics.
        self.frames_sent = 0
        self.silent_frames_sent = 0
        self.samples_dropped = 0
        self.reanchors = 0

    # -- the writer's side (the peer, on the event loop) ---------------------------------------------

    async def write(self, pcm: np.ndarray, sample_rate: int, response_id: str) -> None:
        """Queue int16 mono PCM of `response_id`; waits while the buffer is full."""
        if self.readyState != "live":
            raise MediaStreamError
        if response_id != self._response_id:
            self._begin(response_id)
        if sample_rate != self._resampler_rate:
            self._resampler = _make_resampler(sample_rate)
            self._resampler_rate = sample_rate
        pcm = np.asarray(pcm, dtype=np.int16).reshape(-1)
        resampler = self._resampler
        if resampler is None:
            await self._append(pcm, response_id)
            return
        # A packet's worth at a time, as room frees up, rather than the whole chunk at once: a 16-frame
        # chunk (1.28 s) resampled in one go held the event loop, and every packet due meanwhile, for
        # 70-340 ms on 2 busy cores, and Chromium heard each hold as a gap. The resampler streams, so
        # the pieces make the same samples as the whole.
        piece = max(1, FRAME_SAMPLES * sample_rate // SAMPLE_RATE)
        for start in range(0, pcm.size, piece):
            await self._append(resampler.push(pcm[start : start + piece]), response_id)
            if self._resampler is not resampler:
                return  # cleared (a cancel) or a new response began while we waited for room

    async def end_response(self, response_id: str) -> None:
        """No more audio for `response_id`: flush the resampler; the last frame is padded with silence."""
        if response_id != self._response_id:
            return  # cleared by a cancel, or it never had audio
        if self._resampler is not None:
            await self._append(self._resampler.flush(), response_id)
            self._resampler = None
            self._resampler_rate = 0
        if response_id != self._response_id:
            return  # cleared while the tail was queued
        if self._buffer.size == 0 and self._response_started:
            # Everything already went out: nothing to pad, the response has finished playing.
            self._response_id = None
            self._response_started = False
            if self._on_stopped is not None:
                self._on_stopped(response_id)
            return
        self._response_ending = True
        self._has_data.set()  # a partial last frame is now sendable

    def clear(self) -> int:
        """Barge-in: drop everything queued and forget the current response. Returns samples dropped."""
        dropped = int(self._buffer.size)
        self.samples_dropped += dropped
        self._buffer = np.zeros(0, dtype=np.int16)
        self._resampler = None
        self._resampler_rate = 0
        self._response_id = None
        self._response_started = False
        self._response_ending = False
        self._has_data.clear()
        self._has_room.set()
        return dropped

    @property
    def response_id(self) -> str | None:
        """The response whose audio is queued or playing, if any."""
        return self._response_id

    @property
    def buffered_ms(self) -> float:
        return 1000.0 * self._buffer.size / SAMPLE_RATE

    def _begin(self, response_id: str) -> None:
        if self._response_id is not None and self._buffer.size:
            # A new response while the old one still plays: the old one's tail is dropped, as a
            # barge-in would; peers normally clear() first.
            self.clear()
        self._response_id = response_id
        self._response_started = False
        self.response_frames = 0
        self._response_ending = False
        self._resampler = None
        self._resampler_rate = 0

    async def _append(self, samples: np.ndarray, response_id: str) -> None:
        offset = 0
        while offset < samples.size:
            await self._has_room.wait()
            if self.readyState != "live":
                raise MediaStreamError
            if response_id != self._response_id:
                return  # cleared while we waited for room: this audio was cancelled
            room = self.max_buffer_samples - self._buffer.size
            if room <= 0:
                self._has_room.clear()
                continue
            part = samples[offset : offset + room]
            offset += part.size
            self._buffer = np.concatenate([self._buffer, part])
            if self._buffer.size >= self.max_buffer_samples:
                self._has_room.clear()
            if self._frame_ready():
                self._has_data.set()

    # -- aiortc's side ----------------------------------------------------------------------------------

    async def recv(self) -> av.AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError

        if self.idle == "nothing":
            # Wait for a whole frame, or the padded tail of a finished response. Waiting is a stall:
            # the anchor moves below, so the next frame goes out now, not as part of a burst.
            while not self._frame_ready():
                self._has_data.clear()
                await self._has_data.wait()
                if self.readyState != "live":
                    raise MediaStreamError

        now = self._clock()
        if self._anchor is None:
            self._anchor = now - self._pts / SAMPLE_RATE
        due = self._anchor + self._pts / SAMPLE_RATE
        if now - due > FRAME_SAMPLES / SAMPLE_RATE:
            # More than a frame late (idle, an underrun or a busy loop): re-anchor rather than catch up.
            self._anchor = now - self._pts / SAMPLE_RATE
            self.reanchors += 1
        elif due > now:
            await asyncio.sleep(due - now)
            if self.readyState != "live":
                raise MediaStreamError

        samples, response_id, first, last = self._take_frame()
        frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = SAMPLE_RATE
        frame.time_base = TIME_BASE
        frame.pts = self._pts
        self._pts += FRAME_SAMPLES
        self.frames_sent += 1
        if response_id is None:
            self.silent_frames_sent += 1
        if first and response_id is not None and self._on_started is not None:
            self._on_started(response_id)
        if last and response_id is not None and self._on_stopped is not None:
            self._on_stopped(response_id)
        return frame

    def stop(self) -> None:
        super().stop()
        # Wake anyone waiting so they see the track has ended.
        self._has_data.set()
        self._has_room.set()

    def _frame_ready(self) -> bool:
        """A frame of the response can go out: a whole one (its lead first), or the padded tail at its end."""
        if self._response_id is None:
            return False
        need = FRAME_SAMPLES if self._response_started else self.start_lead_samples
        return self._buffer.size >= need or self._response_ending

    def _take_frame(self) -> tuple[np.ndarray, str | None, bool, bool]:
        """Next 20 ms of samples; which response they belong to; first / last frame of that response."""
        response_id = self._response_id
        if self._frame_ready():
            samples = self._buffer[:FRAME_SAMPLES]
            self._buffer = self._buffer[FRAME_SAMPLES:]
            if samples.size < FRAME_SAMPLES:
                samples = np.concatenate([samples, np.zeros(FRAME_SAMPLES - samples.size, np.int16)])
        else:
            # Idle or an underrun with idle="silence": keep time with a silent frame.
            return np.zeros(FRAME_SAMPLES, np.int16), None, False, False
        if self._buffer.size < self.max_buffer_samples:
            self._has_room.set()
        first = not self._response_started
        self._response_started = True
        self.response_frames += 1
        last = self._response_ending and self._buffer.size == 0
        if last:
            self._response_id = None
            self._response_started = False
            self._response_ending = False
        return samples, response_id, first, last
