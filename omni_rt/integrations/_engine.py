"""Who stops an engine that the framework adapters started, shared by both.

An app may hand one engine that nobody started to several pipelines or realtime models (a bot per call, one
engine loaded per process). The first adapter to need it starts it; it is stopped when the last adapter
using it lets go, never under another one's reply. An engine the app started is the app's to stop.
"""

from __future__ import annotations

import weakref
from typing import Any

# engines the adapters started -> how many adapters use them; weak: a dropped engine leaves nothing behind.
# Module state on purpose: the adapters sharing an engine do not know each other, the engine is the only
# thing they have in common.
_users: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


async def use(engine: Any) -> bool:
    """Start `engine` unless the app runs it; True: the caller is one of its users and must `release` it."""
    if engine not in _users:
        if engine.running:  # the app's
            return False
        _users[engine] = 0
    _users[engine] += 1  # before the await: an adapter starting it now is a user too, never a second owner
    try:
        await engine.start()  # once: a second caller waits for the first start, then finds it running
    except BaseException:
        _users[engine] -= 1
        if not _users[engine]:
            del _users[engine]
        raise
    return True


async def release(engine: Any) -> None:
    """One user of an engine the adapters started lets go of it; the last one stops it."""
    _users[engine] -= 1
    if not _users[engine]:
        del _users[engine]
        await engine.stop()
