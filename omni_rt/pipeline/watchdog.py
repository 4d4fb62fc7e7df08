"""Notices a stage call that never returns, so a stopped device ends in errors, not silence.

A stage iteration on the GPU takes milliseconds. When a device stops making progress (on 2026-12-02 an
H200 stayed 100 % busy for minutes with every stage thread waiting on a read-back, docs/performance.md),
the stage threads block inside CUDA and nothing in the process can take them out again. (Those stops'
cause, two stages' graphs sharing cuBLAS's workspace, is fixed in graphs.py; the watch stays for whatever
else stops a device: a driver fault, a kernel bug.) Without a
watch, every session then waits forever: no audio, no error, a health check that still says ok.

`StallWatch` keeps, per stage, when its current iteration began. A watch thread wakes a few times per
timeout; when an iteration has run longer than `EngineSettings.stall_timeout_s`, it calls `on_stall` once
with the stage and the seconds. The pipeline then ends every response with `EngineStalledError`, refuses
new ones, and reports the stall (the engine's `stall`, the server's /health), and the thread stacks are
written to stderr for whoever reads the log. A stopped device is not recovered in-process: the operator
restarts it.
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class StallWatch:
    def __init__(
        self, timeout_s: float, on_stall: Callable[[str, float], None], clock: Callable[[], float]
    ) -> None:
        self.timeout_s = timeout_s
        self.on_stall = on_stall
        self.clock = clock
        self._since: dict[str, float] = {}  # stage -> start of its running iteration
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @contextmanager
    def busy(self, stage: str) -> Iterator[None]:
        """Around one stage iteration (what runs between two takes from its inbox)."""
        with self._lock:
            self._since[stage] = self.clock()
        try:
            yield
        finally:
            with self._lock:
                self._since.pop(stage, None)

    def longest(self) -> tuple[str, float] | None:
        """The stage whose running iteration began first, and for how many seconds it has run."""
        with self._lock:
            if not self._since:
                return None
            stage, t0 = min(self._since.items(), key=lambda kv: kv[1])
        return stage, self.clock() - t0

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="omni-rt-stall-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None

    def _watch(self) -> None:
        # a quarter of the timeout between looks: a stall is seen within 1.25 timeouts of its start
        while not self._stop.wait(self.timeout_s / 4):
            found = self.longest()
            if found is not None and found[1] > self.timeout_s:
                dump_stacks(f"omni_rt: the {found[0]} stage has not returned for {found[1]:.1f} s")
                self.on_stall(*found)
                return


def dump_stacks(headline: str) -> None:
    """Every thread's Python stack on stderr, under `headline` (what a hang report needs), then their
    native stacks where py-spy is installed and may attach: a Python stack ends at the torch call, and
    only the native frames say which CUDA call (or lock) a thread waits in."""
    try:
        print(headline + "; the threads' stacks follow", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        native = native_stacks()
        if native:
            print(native, file=sys.stderr, flush=True)
    except (OSError, ValueError, AttributeError):  # no usable stderr (a closed or replaced stream)
        pass


def native_stacks(timeout_s: float = 30.0) -> str | None:
    """`py-spy dump --native` of this process, or None without py-spy. A child tracing its parent needs
    ptrace rights (root with CAP_SYS_PTRACE, or kernel.yama.ptrace_scope 0); where it has none, py-spy's
    own error is what this returns."""
    spy = shutil.which("py-spy")
    if spy is None:
        return None
    try:
        done = subprocess.run(
            [spy, "dump", "--native", "--pid", str(os.getpid())],
            capture_output=True, text=True, timeout=timeout_s,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError) as e:
        return f"py-spy dump failed: {e}"
    return "native stacks (py-spy dump --native):\n" + done.stdout + done.stderr
