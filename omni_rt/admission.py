"""Admission control: an engine's ceiling of sessions and of cache memory. Plain Python, no torch.

Sessions: the engine has `EngineSettings.max_sessions` slots (a row of every stage cache each). A
session asked for beyond them gets `SessionLimitError` (code `session_limit`) at once, or, where
`EngineSettings.admission_wait_s` > 0, a place in a first-come-first-served queue: the slot of the next
session to close goes to the oldest request still waiting, and a request that has waited that long
gets the same error. Nobody already admitted is slowed down: the caches are sized for `max_sessions`.

    slots = Slots(8, wait_s=2.0)
    ticket = slots.request()        # a slot now, a place in the queue, or SessionLimitError
    slot = await ticket.wait()      # the slot (at once if it has one); SessionLimitError at the deadline
    ticket.close()                  # the slot goes to the next waiter (or leaves the queue); idempotent

A waiter that is cancelled leaves the queue, and gives back a slot granted to it meanwhile, so
cancellation never leaks a slot. The queue is guarded by a lock, so a slot can be given back from any
thread; a waiter is woken on its own event loop.

Memory: `kv_cache_bytes` is what the stage runners allocate at engine start for a configuration, and
`check_kv_ceiling` refuses one that outgrows `EngineSettings.kv_cache_gib`, naming how many sessions fit.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

from omni_rt.errors import ConfigError, SessionLimitError

__all__ = ["Capacity", "Slots", "Ticket", "check_kv_ceiling", "kv_cache_bytes", "kv_bytes_per_slot"]

GIB = 1024**3
# The Thinker and Talker caches hold one row more than `max_sessions`: the row CUDA graph capture
# writes into (the stage runners allocate `max_sessions + CAPTURE_ROWS`); the code predictor's holds none.
CAPTURE_ROWS = 1


@dataclass(frozen=True)
class Capacity:
    """An engine's admission state (`Engine.capacity`), e.g. for a health endpoint."""

    sessions: int  # admitted and not closed
    max_sessions: int
    waiting: int  # requests queued for a slot (`admission_wait_s`)
    kv_bytes_per_slot: int  # one session's rows of the Thinker, Talker and code predictor caches
    kv_bytes: int  # every row the caches hold, the capture row included

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


# -- sessions ------------------------------------------------------------------------------------------


class Ticket:
    """One request for a slot (see the module doc). `slot` is None until it is granted."""

    def __init__(self, slots: Slots, deadline: float) -> None:
        self._slots = slots
        self._deadline = deadline  # time.monotonic() after which it is refused
        self.slot: int | None = None
        self._closed = False  # closed, timed out or cancelled: it takes no slot any more
        self._wake: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None

    async def wait(self) -> int:
        """The slot: at once if granted, else when a session closes; SessionLimitError at the deadline, or
        as soon as this ticket is closed (its session closed while it waited)."""
        with self._slots._lock:
            if self.slot is not None:
                return self.slot
            if self._closed:
                raise self._slots._limit_error(waited=True)
            if self._wake is None:
                self._wake = (asyncio.get_running_loop(), asyncio.Event())
            woken = self._wake[1]
        try:
            await asyncio.wait_for(woken.wait(), max(0.0, self._deadline - time.monotonic()))
        except TimeoutError:
            pass
        except BaseException:  # cancelled: leave the queue, and give back a slot granted meanwhile
            self.close()
            raise
        with self._slots._lock:
            if self.slot is not None:  # granted, even if at the deadline itself
                return self.slot
        self.close()
        raise self._slots._limit_error(waited=True)

    def close(self) -> None:
        """Give the slot back (to the oldest waiter, else the free list), or leave the queue."""
        self._slots._close(self)

    def _grant(self, slot: int) -> None:  # under the lock
        self.slot = slot
        self._notify()

    def _notify(self) -> None:  # under the lock: a wait() in progress returns (granted) or raises (closed)
        if self._wake is not None:
            loop, event = self._wake
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # its loop is closed: the slot is its own until it is closed
                pass


class Slots:
    """The session slots of one engine: taken by `request()`, given back by `Ticket.close()`."""

    def __init__(self, n: int, wait_s: float = 0.0) -> None:
        self.n = n
        self.wait_s = wait_s
        self._free = list(range(n))
        self._waiting: deque[Ticket] = deque()
        self._lock = threading.Lock()

    @property
    def in_use(self) -> int:
        return self.n - len(self._free)

    @property
    def waiting(self) -> int:
        with self._lock:
            self._drop_expired()
            return len(self._waiting)

    def request(self) -> Ticket:
        """A ticket with a slot, or queued for one (`wait_s` > 0); SessionLimitError when full and
        `wait_s` is 0. A queued ticket's time runs from here."""
        ticket = Ticket(self, time.monotonic() + self.wait_s)
        with self._lock:
            self._drop_expired()
            if self._free and not self._waiting:
                ticket.slot = self._free.pop(0)
            elif self.wait_s > 0:
                self._waiting.append(ticket)
            else:
                ticket._closed = True
                raise self._limit_error(waited=False)
        return ticket

    def _close(self, ticket: Ticket) -> None:
        with self._lock:
            if ticket._closed:
                return
            ticket._closed = True
            slot, ticket.slot = ticket.slot, None
            if slot is None:  # still queued
                if ticket in self._waiting:
                    self._waiting.remove(ticket)
                ticket._notify()  # its wait() ends now, not at its deadline
                return
            self._drop_expired()
            if self._waiting:
                self._waiting.popleft()._grant(slot)
            else:
                self._free.append(slot)
                self._free.sort()

    def _drop_expired(self) -> None:  # under the lock: a ticket past its deadline is never granted
        now = time.monotonic()  # deadlines grow along the queue (one wait_s for all): the oldest goes first
        while self._waiting and self._waiting[0]._deadline <= now:
            self._waiting.popleft()._closed = True

    def _limit_error(self, waited: bool) -> SessionLimitError:
        after = f" after waiting {self.wait_s:g} s" if waited else ""
        return SessionLimitError(f"all {self.n} session slots are in use{after}")


# -- memory --------------------------------------------------------------------------------------------


def kv_bytes_per_slot(cfg: Any, settings: Any, itemsize: int) -> int:
    """Bytes of one session's rows of the stage caches (k and v): the Thinker's at `max_context`, the
    Talker's at `max_talker_context`, the code predictor's at its 16 positions; `cfg` an OmniConfig."""
    rows, predictor = _row_bytes(cfg, settings, itemsize)
    return rows + predictor


def kv_cache_bytes(cfg: Any, settings: Any, itemsize: int, max_sessions: int | None = None) -> int:
    """Bytes the stage caches allocate for `max_sessions` (default: the settings') slots."""
    n = settings.max_sessions if max_sessions is None else max_sessions
    rows, predictor = _row_bytes(cfg, settings, itemsize)
    return (n + CAPTURE_ROWS) * rows + n * predictor


def check_kv_ceiling(cfg: Any, settings: Any, itemsize: int) -> None:
    """A ConfigError when the caches of `settings.max_sessions` outgrow `settings.kv_cache_gib`."""
    if settings.kv_cache_gib is None:
        return
    budget = round(settings.kv_cache_gib * GIB)
    need = kv_cache_bytes(cfg, settings, itemsize)
    if need <= budget:
        return
    rows, predictor = _row_bytes(cfg, settings, itemsize)
    fit = max(0, (budget - CAPTURE_ROWS * rows) // (rows + predictor))
    raise ConfigError(
        f"the caches of {settings.max_sessions} sessions need {need / GIB:.3g} GiB "
        f"({kv_bytes_per_slot(cfg, settings, itemsize) / GIB:.3g} GiB a session at max_context="
        f"{settings.max_context}, max_talker_context={settings.max_talker_context}, plus one capture row) "
        f"and kv_cache_gib is {settings.kv_cache_gib:g}: {fit} sessions fit; lower max_sessions or the "
        "contexts, or raise kv_cache_gib"
    )


def _row_bytes(cfg: Any, settings: Any, itemsize: int) -> tuple[int, int]:
    """(a Thinker row + a Talker row, a code-predictor row) in bytes."""

    def kv(d: Any, length: int) -> int:
        return 2 * d.num_hidden_layers * d.num_key_value_heads * length * d.head_dim * itemsize

    rows = kv(cfg.thinker, settings.max_context) + kv(cfg.talker, settings.max_talker_context)
    return rows, kv(cfg.code_predictor, cfg.num_code_groups)
