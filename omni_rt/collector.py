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
import time

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


class Pauses:
    """The collections that ran while in its `with` block, each (generation, ms): the benchmark's load
    levels report theirs (`summary`), so a late reply can be told from a stall of the whole process."""

    def __init__(self) -> None:
        self.records: list[tuple[int, float]] = []
        self._t0 = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":  # collections never overlap: the collecting thread holds the interpreter lock
            self._t0 = time.perf_counter()
        else:
            self.records.append((info["generation"], (time.perf_counter() - self._t0) * 1e3))

    def __enter__(self) -> Pauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self) -> dict[str, float]:
        """Full collections (generation 2): how many, the longest and their sum (ms); the younger ones'
        sum (ms)."""
        full = [ms for gen, ms in self.records if gen == 2]
        young = [ms for gen, ms in self.records if gen < 2]
        return {
            "full": len(full),
            "full_max_ms": round(max(full, default=0.0), 1),
            "full_ms": round(sum(full), 1),
            "young_ms": round(sum(young), 1),
        }
