"""In-process audio I/O for a LiveKit `AgentSession` without a room: the app's own audio loop (a sound card,
a SIP bridge, a test, an offline run) in front of the agent instead of a LiveKit server.

    session = AgentSession(llm=RealtimeModel(engine))
    session.input.audio = mic = QueueAudioInput()              # mic.push(frame) from the capture callback
    session.output.audio = PlayoutAudioOutput(on_frame=play)   # play(frame) feeds the app's speaker
    await session.start(agent, record=False)

`PlayoutAudioOutput` keeps the playback clock a LiveKit sink must keep: segments play one after another in
real time, so an interruption reports how far each got (what `truncate` then keeps), and a flushed segment
reports its end once its audio has had time to play.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from livekit import rtc
from livekit.agents.voice import io

__all__ = ["QueueAudioInput", "PlayoutAudioOutput"]


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
    t0: float  # when it starts playing (time.monotonic): its first frame, or the end of the one before
    seconds: float = 0.0  # audio captured
    flushed: bool = False
    timer: asyncio.TimerHandle | None = None

    def played(self, now: float) -> float:
        return min(max(now - self.t0, 0.0), self.seconds)


class PlayoutAudioOutput(io.AudioOutput):
    """A sink that plays its segments one after another in real time and hands frames to `on_frame`."""

    def __init__(
        self,
        *,
        on_frame: Callable[[rtc.AudioFrame], None] | None = None,
        label: str = "omni_rt.PlayoutAudioOutput",
    ) -> None:
        super().__init__(label=label, capabilities=io.AudioOutputCapabilities(pause=False))
        self.on_frame = on_frame
        self._segments: list[_Segment] = []  # not finished yet, in order; only the last can be open

    async def capture_frame(self, frame: rtc.AudioFrame) -> None:
        await super().capture_frame(frame)
        if not self._segments or self._segments[-1].flushed:
            now = time.monotonic()
            last = self._segments[-1] if self._segments else None
            self._segments.append(_Segment(t0=max(now, last.t0 + last.seconds) if last else now))
            self.on_playback_started(created_at=time.time())
        self._segments[-1].seconds += frame.samples_per_channel / frame.sample_rate
        if self.on_frame is not None:
            self.on_frame(frame)

    def flush(self) -> None:
        super().flush()
        if not self._segments or self._segments[-1].flushed:
            return
        seg = self._segments[-1]
        seg.flushed = True
        left = max(0.0, seg.t0 + seg.seconds - time.monotonic())
        seg.timer = asyncio.get_running_loop().call_later(left, self._finished, seg, False)

    def clear_buffer(self) -> None:
        for seg in list(self._segments):  # everything queued stops now, each reporting how far it got
            self._finished(seg, True)

    @property
    def position(self) -> float:
        """Seconds of the segment now playing that have been played."""
        return self._segments[0].played(time.monotonic()) if self._segments else 0.0

    def _finished(self, seg: _Segment, interrupted: bool) -> None:
        if seg.timer is not None:
            seg.timer.cancel()
        self._segments.remove(seg)
        self.on_playback_finished(playback_position=seg.played(time.monotonic()), interrupted=interrupted)
