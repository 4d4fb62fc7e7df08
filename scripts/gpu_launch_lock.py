"""What one stage thread's CUDA calls cost another's: graph launches, copies and read-backs across threads.

    PYTHONUNBUFFERED=1 python3 scripts/gpu_launch_lock.py --out $OUT/gpu_launch_lock.json

Why: at 64 conversations on an H200 the stage threads spent much of their time inside CUDA runtime calls
(docs/performance.md, 2026-12-04 third session): 17 launches of the Thinker's 1149-node decode graph took
~2.8 ms of host time each, and py-spy found the Code2Wav and Talker threads blocked on the driver's mutex
inside their copies. Two readings were left open, and they call for different changes:

1. A graph launch costs host time per node and holds the driver's lock meanwhile, so another thread's
   small call waits up to the whole launch. Then launching the Thinker's step as a few shorter graphs
   (`EngineSettings.thinker_graph_segments`) lets the other stages' calls in between.
2. A blocking read-back into pageable memory (`.tolist()`, `.cpu()`) holds the lock while it waits for its
   stream, so a thread reading back a 16 ms Thinker step stalls every other thread's launches. Then a
   copy into pinned memory and a wait on an event would release them (`EngineSettings.pinned_readback`).

Measured here, with no model (tiny kernels make the graphs; `torch.cuda._sleep` makes a stream busy):
- `launch`: host time of one `replay()` of a straight-line graph of N tiny kernels, the queue empty,
  for each N of `--nodes`; and of the same N kernels as K graphs of N/K launched back to back; beside it
  the wall time to the graph's end and its GPU time (their difference: how long the GPU waited for the
  launch, which a graph on the path to first audio adds to it).
- `victim`: a second thread's small calls while a first thread does something else: a 4-int pinned
  host-to-device copy (what `to_device` does), a 40-kernel graph launch, a 16-int read-back (pageable
  `.tolist()`; pinned copy + event), each timed alone on the host, a random 0-1 ms pause between them.
  The first thread: idle; launching a `--big`-node graph back to back (waiting for each on an event);
  the same as `--segments` graphs; a 10 ms busy kernel then a pageable read-back; the same with an event
  wait and a pinned read-back.
Each figure: p50 / p90 / max of the victim's host times in microseconds. A large p90 beside the launching
thread and a small one beside the segments says reading 1; a large one beside the pageable read-back and
a small one beside the event says reading 2.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
from pathlib import Path

import torch


def tiny_graph(
    n: int, dev: torch.device, stream: torch.cuda.Stream
) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """A straight-line graph of `n` tiny kernels (each adds to a 256-float vector)."""
    x = torch.zeros(256, device=dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(stream):
        x.add_(1.0)  # warm-up outside the capture
    torch.cuda.synchronize(dev)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        for _ in range(n):
            x.add_(1.0)
    torch.cuda.synchronize(dev)
    return g, x


def pct(values: list[float]) -> dict:
    v = sorted(values)
    if not v:
        return {"n": 0}
    return {
        "n": len(v),
        "p50": round(v[len(v) // 2], 1),
        "p90": round(v[min(len(v) - 1, int(len(v) * 0.9))], 1),
        "max": round(v[-1], 1),
    }


def launch_costs(dev: torch.device, nodes: list[int], segments: int, reps: int) -> list[dict]:
    """Per graph size: the host time of the launch call(s), the wall time from the call to the stream's
    end, and the GPU time between events around the launch(es): wall - gpu is about how long the GPU
    waited for the launch before its first kernel (plus one synchronize)."""
    stream = torch.cuda.Stream(device=dev)
    rows = []
    for n in nodes:
        whole, _ = tiny_graph(n, dev, stream)
        parts = [tiny_graph(max(1, n // segments), dev, stream)[0] for _ in range(segments)]
        for label, graphs in ((f"1 graph of {n}", [whole]), (f"{segments} graphs of {n // segments}", parts)):
            host, wall, gpu = [], [], []
            with torch.cuda.stream(stream):
                for _ in range(reps):
                    torch.cuda.synchronize(dev)
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    t0 = time.perf_counter()
                    start.record()
                    for g in graphs:
                        g.replay()
                    end.record()
                    t1 = time.perf_counter()
                    end.synchronize()
                    t2 = time.perf_counter()
                    host.append((t1 - t0) * 1e6)
                    wall.append((t2 - t0) * 1e6)
                    gpu.append(start.elapsed_time(end) * 1e3)
            torch.cuda.synchronize(dev)
            rows.append(
                {
                    "what": label,
                    "nodes": n,
                    "host_us": pct(host),
                    "wall_us": pct(wall),
                    "gpu_us": pct(gpu),
                    "us_per_node": round(statistics.median(host) / n, 2),
                }
            )
    return rows


class Victim:
    """A thread timing small CUDA calls on its own stream, one kind after another, until stopped."""

    def __init__(self, dev: torch.device) -> None:
        self.dev = dev
        self.stream = torch.cuda.Stream(device=dev, priority=-1)
        self.small, _ = tiny_graph(40, dev, self.stream)
        self.ids = torch.arange(16, device=dev)
        self.times: dict[str, list[float]] = {}
        self._stop = threading.Event()

    def _time(self, name: str, fn) -> None:
        t0 = time.perf_counter()
        fn()
        self.times.setdefault(name, []).append((time.perf_counter() - t0) * 1e6)

    def _pinned_readback(self) -> list[int]:
        host = torch.empty(16, dtype=torch.long, pin_memory=True)
        host.copy_(self.ids, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        done.synchronize()
        return host.tolist()

    def run(self) -> None:
        rng = random.Random(0)
        with torch.cuda.stream(self.stream):
            while not self._stop.is_set():
                self._time(
                    "h2d pinned (to_device)",
                    lambda: torch.tensor([1, 2, 3, 4]).pin_memory().to(self.dev, non_blocking=True),
                )
                time.sleep(rng.random() / 1000)
                self._time("40-node graph launch", self.small.replay)
                time.sleep(rng.random() / 1000)
                self._time("read-back pageable (.tolist)", lambda: self.ids.tolist())
                time.sleep(rng.random() / 1000)
                self._time("read-back pinned + event", self._pinned_readback)
                time.sleep(rng.random() / 1000)

    def measure(self, seconds: float) -> dict:
        self.times, self._stop = {}, threading.Event()
        t = threading.Thread(target=self.run, daemon=True)
        t.start()
        time.sleep(seconds)
        self._stop.set()
        t.join()
        return {k: pct(v) for k, v in self.times.items()}


def aggressor(
    kind: str, dev: torch.device, big: int, segments: int, stop: threading.Event, log: list[float]
) -> None:
    """The first thread's loop, on its own stream, until `stop`; its own launch (or wait) host times in `log`."""
    stream = torch.cuda.Stream(device=dev)
    whole, _ = tiny_graph(big, dev, stream)
    parts = [tiny_graph(max(1, big // segments), dev, stream)[0] for _ in range(segments)]
    out = torch.zeros(16, dtype=torch.long, device=dev)
    with torch.cuda.stream(stream):
        while not stop.is_set():
            t0 = time.perf_counter()
            if kind == "launching one big graph":
                whole.replay()
            elif kind == "launching it as segments":
                for g in parts:
                    g.replay()
            if kind.startswith("launching"):
                log.append((time.perf_counter() - t0) * 1e6)
                done = torch.cuda.Event()
                done.record()
                done.synchronize()
                continue
            torch.cuda._sleep(10_000_000)  # ~5-10 ms busy on the stream (clock dependent)
            t0 = time.perf_counter()
            if kind == "busy kernel, pageable read-back":
                out.tolist()
            else:  # "busy kernel, event wait + pinned read-back"
                host = torch.empty(16, dtype=torch.long, pin_memory=True)
                host.copy_(out, non_blocking=True)
                done = torch.cuda.Event()
                done.record()
                done.synchronize()
            log.append((time.perf_counter() - t0) * 1e6)


def interference(dev: torch.device, big: int, segments: int, seconds: float) -> list[dict]:
    victim = Victim(dev)
    victim.measure(0.2)  # warm-up: pinned blocks, lazy inits
    rows = []
    kinds = [
        "idle",
        "launching one big graph",
        "launching it as segments",
        "busy kernel, pageable read-back",
        "busy kernel, event wait + pinned read-back",
    ]
    for kind in kinds:
        stop, log = threading.Event(), []
        t = None
        if kind != "idle":
            t = threading.Thread(target=aggressor, args=(kind, dev, big, segments, stop, log), daemon=True)
            t.start()
            time.sleep(0.3)  # its graphs captured and running
            log.clear()
        victim_times = victim.measure(seconds)
        stop.set()
        if t is not None:
            t.join()
        torch.cuda.synchronize(dev)
        rows.append({"first thread": kind, "its own call us": pct(log), "victim us": victim_times})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="JSON file to write")
    ap.add_argument("--nodes", default="100,400,1200,2400", help="graph sizes for the launch-cost table")
    ap.add_argument(
        "--big", type=int, default=1200, help="nodes of the first thread's graph (the Thinker's: 1149)"
    )
    ap.add_argument("--segments", type=int, default=4, help="the big graph as this many graphs")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--seconds", type=float, default=3.0, help="victim sampling time per first-thread kind")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    dev = torch.device("cuda")
    res = {
        "device": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "launch": launch_costs(dev, [int(n) for n in args.nodes.split(",")], args.segments, args.reps),
        "interference": interference(dev, args.big, args.segments, args.seconds),
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1))
    print("\nlaunch, queue empty, us p50: host time of the launch call(s) (per node), wall to the end, GPU")
    for r in res["launch"]:
        h, w, g = r["host_us"], r["wall_us"], r["gpu_us"]
        print(
            f"  {r['what']:<24} host {h['p50']:>8} ({r['us_per_node']}/node)  wall {w['p50']:>8}  gpu {g['p50']:>8}"
        )
    print("\nthe victim thread's calls beside the first thread (us p50 / p90 / max)")
    for r in res["interference"]:
        own = r["its own call us"]
        print(f"  first thread: {r['first thread']} (its calls p50 {own.get('p50')} us)")
        for name, v in r["victim us"].items():
            print(f"    {name:<32} {v.get('p50'):>8} {v.get('p90'):>8} {v.get('max'):>8}  (n {v['n']})")


if __name__ == "__main__":
    main()
