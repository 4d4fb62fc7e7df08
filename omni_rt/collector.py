"""The cycle collector while engines and servers run: what is alive when the first of them starts (the
model, torch, the libraries, the app's own long-lived objects) is frozen out of the collector's sight
(`gc.freeze`) until the last one stops, so a full collection scans only what came later.

Why: a full collection holds the interpreter lock while it walks every tracked object, and every stage
thread, the event loop and the transport wait. Unfrozen, one took 380-480 ms in the browser test's process
(docs/performance.md, 2026-12-01 night), ~50 ms with torch and omni_rt imported alone, 131 ms in a
load simulation's process; a reply's first audio has ~57 ms of slack before its second chunk is due.
Frozen objects are still freed by reference counting; only cycles among them wait for the last `release`.
`EngineSettings.freeze_collector` switches it off for an engine.
"""

from __future__ import annotations

import gc
import threading

_lock = threading.Lock()
_holds = 0  # engines and servers running that asked for the freeze


def hold() -> None:
    """Freeze what is alive now (after a collection, so no garbage is frozen with it) and count a hold."""
    global _holds
    with _lock:
        if _holds == 0:
            gc.collect()
        gc.freeze()  # a later hold freezes what came since (the server's libraries after the engine)
        _holds += 1


def release() -> None:
    """Count a hold off; at the last, everything frozen is back in the collector's sight."""
    global _holds
    with _lock:
        if _holds == 0:
            return
        _holds -= 1
        if _holds == 0:
            gc.unfreeze()


def holds() -> int:
    """Engines and servers holding the freeze now."""
    return _holds
