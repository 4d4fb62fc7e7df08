"""In-process audio I/O for a LiveKit `AgentSession` without a room: the app's own audio loop (a sound card,
a SIP bridge, a test, an offline run) in front of the agent instead of a LiveKit server.

    session = AgentSession(llm=RealtimeModel(engine))
    session.input.audio = mic = QueueAudioInput()              # mic.push(frame) from the capture callback
    session.output.audio = PlayoutAudioOutput(on_frame=play)   # play(frame) feeds the app's speaker
    await session.start(agent, record=False)

`PlayoutAudioOutput` plays like a sound card the app owns: each frame goes to `on_frame` when it is due (a
`lead` ahead, so the app's own buffer never runs dry), segments one after another in real time. Its
playback clock is what a LiveKit sink must report: an interruption says how far each segment got (what
`truncate` then keeps), a flushed segment ends once its audio has played. It can pause: the framework
pauses the agent when the user starts talking and resumes it if that was no interruption (livekit's
`resume_false_interruption`); while paused nothing goes out and the clock stands still.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from livekit import rtc
from livekit.agents.voice import io

__all__ = ["QueueAudioInput", "PlayoutAudioOutput"]

log = logging.getLogger("omni_rt.integrations")


class QueueAudioInput(io.AudioInput):
    """Frames pushed from anywhere on the loop, read by the session as mono frames (a room's input is
    mono, and the framework's own VAD takes nothing else: a stereo capture is downmixed). Bounded: when the
    session falls behind by `max_frames`, the oldest frames go (live audio is worth more than old audio)."""

    def __init__(self, *, max_frames: int = 500, label: str = "omni_rt.QueueAudioInput") -> None:
        super().__init__(label=label)
        self._queue: asyncio.Queue[rtc.AudioFrame | None] = asyncio.Queue(maxsize=max_frames)
        self.dropped = 0

    def push(self, frame: rtc.AudioFrame) -> None:
        if frame.num_channels > 1:
            pcm = np.frombuffer(frame.data, np.int16).reshape(-1, frame.num_channels)
            mono = pcm.mean(axis=1).round().astype(np.int16)
            frame = rtc.AudioFrame(mono.tobytes(), frame.sample_rate, 1, len(mono))
        if self._queue.full():
            self._queue.get_nowait()
            self.dropped += 1
        self._queue.put_nowait(frame)

    def close(self) -> None:
        """End the input: the session's read loop stops once it has read what came before."""
        if self._queue.full():
            self._queue.get_nowait()
        self._queue.put_nowait(None)

    async def __anext__(self) -> rtc.AudioFrame:
        frame = await self._queue.get()
        if frame is None:
            raise StopAsyncIteration
        return frame


@dataclass(eq=False)
class _Segment:
    # Where it lies on the sink's timeline (seconds of audio queued before it, and with it). Positions are
    # sums of the same frame durations in the same order, so a segment's end is the next one's start, and
    # the playhead stopped at the timeline's end is exactly at the last one's.
    start: float
    end: float
    frames: deque[tuple[float, rtc.AudioFrame]] = field(default_factory=deque)  # not handed out yet
    started: bool = False  # its first frame went out
    flushed: bool = False

    @property
    def seconds(self) -> float:
        return self.end - self.start

    def played(self, at: float) -> float:
        """Seconds of it played with the playhead at `at` on the timeline."""
        return min(max(at - self.start, 0.0), self.seconds)


class PlayoutAudioOutput(io.AudioOutput):
    """A sink that plays its segments one after another in real time: each frame goes to `on_frame` once the
    playhead is within `lead` seconds of its start. Pausable; an exception in `on_frame` is logged and the
    audio plays on. Frames handed out ahead of the playhead are the app's: on an interruption
    (`playback_finished` with `interrupted=True`) an app with a deep device buffer drops them there."""

    def __init__(
        self,
        *,
        on_frame: Callable[[rtc.AudioFrame], None] | None = None,
        lead: float = 0.06,
        label: str = "omni_rt.PlayoutAudioOutput",
    ) -> None:
        if lead < 0:
            raise ValueError(f"lead must be >= 0 seconds, not {lead}")
        super().__init__(label=label, capabilities=io.AudioOutputCapabilities(pause=True))
        self.on_frame = on_frame
        self.lead = lead
        self._segments: deque[_Segment] = deque()  # not finished yet, in order; only the last can be open
        # One timeline for all segments: `_end` seconds queued, `_played` of them played at `_since`
        # (time.monotonic()), from where the playhead runs in real time until it reaches `_end` (the audio
        # ran dry) or the sink pauses (`_since` is None): paused time and gaps are never counted as played.
        self._end = 0.0
        self._played = 0.0
        self._since: float | None = time.monotonic()
        self._run = 0.0  # where the playhead's unbroken run began: what the next progress report covers
        self._discard = False  # the open segment was cleared: frames until its flush are dropped
        self._timer: asyncio.TimerHandle | None = None  # the next frame or segment end due; none while paused

    @property
    def paused(self) -> bool:
        return self._since is None

    @property
    def position(self) -> float:
        """Seconds of the segment now playing that have been played."""
        return self._segments[0].played(self._playhead(time.monotonic())) if self._segments else 0.0

    async def capture_frame(self, frame: rtc.AudioFrame) -> None:
        await super().capture_frame(frame)
        if self._discard:
            return
        now = time.monotonic()
        if self._since is not None and self._playhead(now) >= self._end:
            # the audio ran dry: the run ended then, and the playhead waits for this frame, not after it
            if self._segments:
                self._report(self._segments[0], self._end, now)
            self._played, self._since, self._run = self._end, now, self._end
        if not self._segments or self._segments[-1].flushed:
            self._segments.append(_Segment(start=self._end, end=self._end))
        seg = self._segments[-1]
        seg.frames.append((self._end, frame))
        self._end += frame.duration
        seg.end = self._end
        self._tick()

    def flush(self) -> None:
        super().flush()
        self._discard = False
        if self._segments and not self._segments[-1].flushed:
            self._segments[-1].flushed = True
            self._tick()  # it may have played already

    def clear_buffer(self) -> None:
        now = time.monotonic()
        at = self._playhead(now)
        if self._segments and not self._segments[-1].flushed:
            self._discard = True  # the base class counts the frames up to the flush in this segment
        while self._segments:  # everything queued stops now, each reporting how far it got
            self._finish(self._segments[0], at, now, interrupted=True)
        # what was not played never will be: the next segment starts where the playhead stopped
        self._end = self._played = self._run = at
        if self._since is not None:
            self._since = now
        self._cancel_timer()

    def pause(self) -> None:
        super().pause()
        if self._since is None:
            return
        self._tick()  # segments that have ended report so first: a report belongs to the segment playing
        now = time.monotonic()
        at = self._playhead(now)
        if self._segments:
            self._report(self._segments[0], at, now)
        self._played, self._since = at, None
        self._cancel_timer()

    def resume(self) -> None:
        super().resume()  # the framework resumes at every reply's start, paused or not
        if self._since is not None:
            return
        self._since = time.monotonic()
        self._run = self._played
        self._tick()

    def _playhead(self, now: float) -> float:
        if self._since is None:
            return self._played
        return min(self._played + now - self._since, self._end)

    def _tick(self) -> None:
        """Hand out the frames due, end the segments played to their end, and wait for the next of either."""
        self._cancel_timer()
        if self._since is None:
            return
        now = time.monotonic()
        at = self._playhead(now)
        while (seg := self._due(at)) is not None:
            self._hand(seg, at)
            if self._since is None:  # on_frame paused the sink
                return
        while self._segments and self._segments[0].flushed and not self._segments[0].frames:
            if at < self._segments[0].end:
                break
            self._finish(self._segments[0], at, now, interrupted=False)
        waits = [self._segments[0].end - at] if self._segments and self._segments[0].flushed else []
        if (seg := next((s for s in self._segments if s.frames), None)) is not None:
            waits.append(seg.frames[0][0] - self.lead - at)
        self._cancel_timer()  # one on_frame's flush may have armed one
        if waits:
            self._timer = asyncio.get_running_loop().call_later(max(min(waits), 0.0), self._tick)

    def _due(self, at: float) -> _Segment | None:
        """The segment whose next frame is due, if one is: frames go out in order, across segments too."""
        for seg in self._segments:
            if seg.frames:
                return seg if seg.frames[0][0] <= at + self.lead else None
        return None

    def _hand(self, seg: _Segment, at: float) -> None:
        _, frame = seg.frames.popleft()
        if not seg.started:  # it starts playing when the playhead reaches it, at most `lead` from now
            seg.started = True
            self.on_playback_started(created_at=time.time() + max(seg.start - at, 0.0))
        if self.on_frame is None:
            return
        try:
            self.on_frame(frame)
        except Exception:  # the app's speaker failing once must not end the agent's voice
            log.exception("%s: on_frame raised; the playout goes on", self.label)

    def _report(self, seg: _Segment, upto: float, now: float) -> None:
        """Report the stretch of `seg` played in the current run, up to timeline position `upto` (the
        framework's recorder places the agent's audio by these, so a paused reply is placed in pieces)."""
        lo, hi = max(self._run, seg.start), min(upto, seg.end)
        if hi > lo and self._since is not None:
            began = time.time() - (now - self._since) - (self._played - lo)  # the playhead ran unbroken since
            self.on_playback_progressed(started_at=began, offset=lo - seg.start, duration=hi - lo)
        self._run = max(self._run, hi)

    def _finish(self, seg: _Segment, at: float, now: float, interrupted: bool) -> None:
        self._report(seg, at, now)
        self._segments.remove(seg)
        self.on_playback_finished(playback_position=seg.played(at), interrupted=interrupted)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
