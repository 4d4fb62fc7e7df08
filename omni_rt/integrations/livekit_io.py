"""In-process audio I/O for a LiveKit `AgentSession` without a room: the app's own audio loop (a sound card,
a SIP bridge, a test, an offline run) in front of the agent instead of a LiveKit server.

    session = AgentSession(llm=RealtimeModel(engine))
    session.input.audio = mic = QueueAudioInput()              # mic.push(frame) from the capture callback
    session.output.audio = PlayoutAudioOutput(on_frame=play)   # play(frame) feeds the app's speaker
    await session.start(agent, record=False)

`PlayoutAudioOutput` keeps the playback clock a LiveKit sink must keep: a segment plays in real time from
its first frame, so an interruption reports how far it got (what `truncate` then keeps), and a flushed
segment reports its end once its audio has had time to play.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from livekit import rtc
from livekit.agents.voice import io

__all__ = ["QueueAudioInput", "PlayoutAudioOutput"]


class QueueAudioInput(io.AudioInput):
    """Frames pushed from anywhere on the loop, read by the session. Bounded: when the session falls
    behind by `max_frames`, the oldest frames go (live audio is worth more than old audio)."""

    def __init__(self, *, max_frames: int = 500, label: str = "omni_rt.QueueAudioInput") -> None:
        super().__init__(label=label)
        self._queue: asyncio.Queue[rtc.AudioFrame | None] = asyncio.Queue(maxsize=max_frames)
        self.dropped = 0

    def push(self, frame: rtc.AudioFrame) -> None:
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


class PlayoutAudioOutput(io.AudioOutput):
    """A sink that plays each segment in real time from its first frame and hands frames to `on_frame`."""

    def __init__(
        self,
        *,
        on_frame: Callable[[rtc.AudioFrame], None] | None = None,
        label: str = "omni_rt.PlayoutAudioOutput",
    ) -> None:
        super().__init__(label=label, capabilities=io.AudioOutputCapabilities(pause=False))
        self.on_frame = on_frame
        self._open = False  # a segment was captured and has not reported its end
        self._t0 = 0.0  # when the segment started playing (time.monotonic)
        self._seconds = 0.0  # audio captured in the segment
        self._finish: asyncio.TimerHandle | None = None

    async def capture_frame(self, frame: rtc.AudioFrame) -> None:
        await super().capture_frame(frame)
        if not self._open:
            self._open, self._t0, self._seconds = True, time.monotonic(), 0.0
            self.on_playback_started(created_at=time.time())
        self._seconds += frame.samples_per_channel / frame.sample_rate
        if self.on_frame is not None:
            self.on_frame(frame)

    def flush(self) -> None:
        super().flush()
        if not self._open or self._finish is not None:
            return
        left = max(0.0, self._t0 + self._seconds - time.monotonic())
        self._finish = asyncio.get_running_loop().call_later(left, self._finished, False)

    def clear_buffer(self) -> None:
        if self._open:
            self._finished(True)

    @property
    def position(self) -> float:
        """Seconds of the current segment played so far."""
        return min(time.monotonic() - self._t0, self._seconds) if self._open else 0.0

    def _finished(self, interrupted: bool) -> None:
        if self._finish is not None:
            self._finish.cancel()
            self._finish = None
        position = self.position
        self._open = False
        self.on_playback_finished(playback_position=position, interrupted=interrupted)
