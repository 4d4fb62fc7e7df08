"""One connection's speculative reply: started at a pause that may end the user's turn, released when
the turn ends there, dropped when the voice goes on.

At a pause (`live_turn.py`: `TAIL_MS` of silence after the voice, where semantic_vad asks its
end-of-turn model), the peer starts the reply that the end of the turn would start: the same input
(the waiting user text and this turn's clip), the same limits (`Session.speculate`, output held back).
When the turn ends and its committed clip is that clip, the reply is released: its events go out from
`response.created` on, as if it had started then, with most of its work (the prefill, the first
frames) already done; `voice_to_voice_ms` still counts from the end of speech to the first audio that
goes out. When the voice resumes, or anything else changes what the reply would answer, it is dropped:
nothing went out, and the session is as it was. `turn_detection.speculative_response: false` (an
omni_rt extension of the session configuration) turns it off.

Drops are asynchronous (the pipeline lets go of a request within a frame); any response the peer
starts waits for them first (`settled`), since a session holds one response at a time.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("omni_rt.server")


class Speculator:
    def __init__(self, name: str, spawn: Callable[[Any, str], asyncio.Task]) -> None:
        self.name = name
        self._spawn = spawn
        self._current: tuple[Any, Any, tuple] | None = None  # (session, Speculation, what it answers)
        self._dropping: set[asyncio.Task] = set()  # drops under way
        self._starting: set[asyncio.Task] = set()  # starts waiting for them
        self.started = self.released = self.dropped = 0  # counters, for tests and the benchmark

    def start(self, session: Any, key: tuple, **respond: Any) -> None:
        """Start a held reply on `session` answering `key` (the waiting text and the turn's clip), after
        any drop still in progress; `respond`: `Session.speculate`'s arguments."""
        self.drop()
        self._current = (session, None, key)
        entry = self._current

        async def begin() -> None:
            await self._drops()
            if self._current is not entry:  # taken or dropped meanwhile: nothing to start
                return
            try:
                spec = session.speculate(**respond)
            except Exception as exc:  # e.g. the session closing: the turn is answered as usual
                log.info("peer %s: no speculative reply: %s", self.name, exc)
                self._current = None
                return
            self._current = (session, spec, key)
            self.started += 1

        self._track(self._starting, self._spawn(begin(), "speculate"))

    def take(self, session: Any, key: tuple) -> Any:
        """The held reply if it answers exactly `key` on `session` (the caller releases it), else None
        (and any other is dropped)."""
        current, self._current = self._current, None
        if current is not None:
            owner, spec, answers = current
            if spec is not None and owner is session and _same(answers, key) and not spec.failed:
                self.released += 1
                return spec
            self._current = current
            self.drop()
        return None

    def drop(self) -> None:
        """The reply held, if any, goes without a trace (in a task: see `settled`)."""
        current, self._current = self._current, None
        if current is None or current[1] is None:
            return
        self.dropped += 1
        self._track(self._dropping, self._spawn(self._drop(current[1]), "drop speculation"))

    async def _drop(self, spec: Any) -> None:
        try:
            await spec.drop()
        except Exception:  # the pipeline did not let go in time: the next response will say so
            log.exception("peer %s: a speculative reply did not stop", self.name)

    async def _drops(self) -> None:
        while self._dropping:
            await asyncio.gather(*self._dropping, return_exceptions=True)

    async def settled(self) -> None:
        """Once every start and drop has finished: after `take`, the session holds no other reply."""
        while self._dropping or self._starting:
            await asyncio.gather(*self._dropping, *self._starting, return_exceptions=True)

    async def close(self) -> None:
        self.drop()
        await self.settled()

    @staticmethod
    def _track(tasks: set[asyncio.Task], task: asyncio.Task) -> None:
        tasks.add(task)
        task.add_done_callback(tasks.discard)


def _same(a: tuple, b: tuple) -> bool:
    """Whether two replies answer the same: (text, clip, limits), the clip the very same object (the
    turn's committed clip is the pause's when its audio is, `LiveTurn.finish`)."""
    return a[0] == b[0] and a[1] is b[1] and _plain(a[2]) == _plain(b[2])


def _plain(limits: dict) -> dict:
    return {k: v for k, v in limits.items() if k != "audio"}
