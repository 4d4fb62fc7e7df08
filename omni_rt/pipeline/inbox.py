"""A stage's inbox: a deque guarded by a Condition. Senders `put`; the stage thread `take`s everything
that has landed, sleeping on the Condition (no timeout, no polling) while there is nothing to do.

`waits` and `wakeups` count how often the receiver slept and woke, so the policy tests can show that
every wake-up was caused by a message (no polling loop).
"""

from __future__ import annotations

import threading
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

    def take(self, block: bool) -> list[Any]:
        """Everything queued, oldest first. With `block`, sleep until something arrives.

        Raises InboxClosed once the inbox is closed (after a stop), so the stage thread can exit.
        """
        with self._cond:
            while block and not self._items and not self._closed:
                self.waits += 1
                self._cond.wait()  # woken by put() or close(); never by a timer
                if not self._items and not self._closed:
                    self.empty_wakeups += 1
            if self._closed:
                raise InboxClosed(self.name)
            items = list(self._items)
            self._items.clear()
            return items
