"""A response started before its turn is known to be over: the reply ready when the user stops.

    spec = session.speculate(audio=clip, max_output_tokens=256)   # at a pause; its output held back
    async for ev in spec.release(): ...     # the turn ended: every event, as if it started now
    await spec.drop()                       # the user went on: no event, nothing changed

The pipeline runs it as any response (prefill, first frames, and on until its limits); the session
holds its messages unread and its turn uncommitted. Released, its events flow from the start
(`response.created` first) and its turn commits as any other, at release if it finished while held;
its metrics count from the speculative start, and `held_ms` says how long the output waited.
Dropped, its request is cancelled and nothing of it stays: no event was read, the conversation and
what the caches are trusted to hold are as before (the cache rows it wrote lie past that, and the next
prefill writes over them), and the session's last response is the one before it. A speculation that
could not be made (one that would truncate the conversation, any error before its output) is
`failed`: the caller drops it and answers the turn as usual.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from omni_rt.events import ErrorEvent, Event

if TYPE_CHECKING:
    from omni_rt.session import Session

__all__ = ["Hold", "Speculation"]

_END = object()


@dataclass(eq=False)
class Hold:
    """The session's record of a speculative response (see `Session.speculate`)."""

    previous: Any  # the session's last response before this one (what a drop restores)
    released: asyncio.Event = field(default_factory=asyncio.Event)
    released_at: float | None = None  # time.perf_counter() of the release
    resp: Any = None  # the session's _Response, once it is built
    speculation: Any = None


class Speculation:
    def __init__(self, session: Session, stream: AsyncIterator[Event], hold: Hold) -> None:
        self._session = session
        self._hold = hold
        self._queue: asyncio.Queue = asyncio.Queue()  # events before release: created, then any error
        self.failed = False  # an error came before release: the caller answers the turn as usual
        self._dropped = False
        self._task = asyncio.get_running_loop().create_task(self._drive(stream))

    @property
    def released(self) -> bool:
        return self._hold.released.is_set()

    async def _drive(self, stream: AsyncIterator[Event]) -> None:
        """Run the response: it is built and submitted at once; its events wait here for `release`."""
        try:
            async with contextlib.aclosing(stream):
                async for ev in stream:
                    if isinstance(ev, ErrorEvent) and not self.released:
                        self.failed = True
                    self._queue.put_nowait(ev)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # for the reader, after release
            self._queue.put_nowait(e)
        finally:
            self._queue.put_nowait(_END)

    def release(self) -> AsyncIterator[Event]:
        """Its events, from `response.created` on; held output comes at once, the rest as it is made."""
        if self._dropped:
            raise RuntimeError("a dropped speculation cannot be released")
        if self.released:  # again, it would commit its turn over later ones and its events are taken
            raise RuntimeError("this speculation is released already: its events went to the first release()")
        self._session._release_held(self._hold)
        return self._events()

    async def _events(self) -> AsyncIterator[Event]:
        try:
            while (item := await self._queue.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:  # the reader stopped early: stop the response, as leaving respond()'s loop does
            if not self._task.done():
                self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)

    async def drop(self) -> None:
        """Cancel it, leaving no trace (see the module doc). Nothing to do once released."""
        if self.released or self._dropped:
            return
        self._dropped = True
        hold, session = self._hold, self._session
        resp = hold.resp
        try:
            if resp is not None and not resp.done.is_set():
                await session._stop(resp, "a dropped speculative response")
        finally:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            session._forget_held(hold)
