"""A stage's inbox: a deque guarded by a Condition. Senders `put`; the stage thread `take`s everything
that has landed, sleeping on the Condition (no polling) while there is nothing to do, or until a deadline
of its own (`timeout`: Code2Wav's early chunk, due by the clock).

`waits` and `empty_wakeups` count how often the receiver slept and woke with nothing (not counting a
wake at its deadline), so the policy tests can show that every other wake-up was caused by a message (no
polling loop).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any


class InboxClosed(Exception):
    pass


class Inbox:
    def __init__(self, name: str) -> None:
        self.name = name
        self._items: deque[Any] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self.puts = 0
        self.waits = 0  # times the receiver went to sleep
        self.empty_wakeups = 0  # times it woke with nothing to read (spurious or close)

    def put(self, item: Any) -> None:
        with self._cond:
            self._items.append(item)
            self.puts += 1
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def holds(self, test) -> bool:
        """Is something queued for which `test(item)` is true? Nothing is taken out."""
        with self._cond:
            return any(test(item) for item in self._items)

    def take(self, block: bool, timeout: float | None = None) -> list[Any]:
        """Everything queued, oldest first. With `block`, sleep until something arrives, or for at most
        `timeout` seconds (then possibly nothing).

        Raises InboxClosed once the inbox is closed (after a stop), so the stage thread can exit.
        """
        with self._cond:
            deadline = None if timeout is None else time.monotonic() + timeout
            while block and not self._items and not self._closed:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self.waits += 1
                self._cond.wait(left)  # woken by put() or close(), or at the deadline; never polling
                if not self._items and not self._closed and (deadline is None or time.monotonic() < deadline):
                    self.empty_wakeups += 1
            if self._closed:
                raise InboxClosed(self.name)
            items = list(self._items)
            self._items.clear()
            return items
