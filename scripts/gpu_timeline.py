"""What a profiled window says about each stage thread's GPU work: launch → start, span, busy.

    python scripts/gpu_timeline.py trace.json.gz --threads threads.json

Reads a `torch.profiler` Chrome trace (CUDA activity on, so it holds the CUDA runtime calls of every
thread and the kernels they launched, tied by correlation id) and a {native thread id: name} map. For
every graph launch and kernel launch of each named thread: the wait from the host's launch call to its
first kernel's start (the GPU queue and the SMs taken by other streams), the span from the first kernel's
start to the last one's end, and the busy time (its kernels' summed durations: longer than alone when
they share SMs and memory). Per thread also the host time in each runtime call (a long
`cudaStreamSynchronize` or `cudaMemcpyAsync` is the thread waiting for the GPU), and for the window the
time the GPU ran any kernel and how many streams ran at once.

Why: at 64 conversations a Code2Wav call took ~39 ms of host time against 2.45 ms alone on an H200, and
beside one Thinker-like stream (scripts/gpu_contention.py) ~7.6 ms; this says how much of the 39 ms is
GPU time and how much is the host (docs/performance.md, 2026-12-04 (third session)).
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

LAUNCHES = (
    "cudaGraphLaunch",
    "cudaLaunchKernel",
    "cudaLaunchKernelExC",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
)


def _load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def _pcts(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    v = sorted(values)
    return {
        "n": len(v),
        "p50": v[len(v) // 2],
        "p90": v[min(len(v) - 1, int(0.9 * len(v)))],
        "max": v[-1],
        "mean": statistics.fmean(v),
    }


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def timeline(events: list[dict], threads: dict[int, str], sequence: int = 0) -> dict:
    """The per-thread launch statistics (ms) of a trace's events; see the module docstring. With
    `sequence`, also the first `sequence` launches of the named threads in host order (`launches`: ms
    from the first one's call: the call, its first kernel's start and last kernel's end; kernels; busy),
    which for one request is the path to its first audio."""
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    by_corr: dict[int, list[dict]] = defaultdict(list)
    for k in kernels:
        c = k.get("args", {}).get("correlation")
        if c is not None:
            by_corr[c].append(k)
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver") and "dur" in e]
    # grouped by the stream the launch's kernels ran on (each stage has its own), not by host thread: the
    # trace's thread ids for runtime calls need not be the OS ids
    per_stream: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    first_kernel: dict[str, str] = {}
    seq = []
    for e in runtime:
        if e["name"] not in LAUNCHES:
            continue
        ks = by_corr.get(e.get("args", {}).get("correlation"), [])
        if not ks:
            continue
        stream = str(ks[0].get("args", {}).get("stream", "?"))
        kind = "graph" if e["name"] == "cudaGraphLaunch" else "kernel"
        start = min(k["ts"] for k in ks)
        end = max(k["ts"] + k["dur"] for k in ks)
        g = per_stream[stream]
        g[f"{kind} wait ms"].append((start - e["ts"]) / 1e3)
        g[f"{kind} span ms"].append((end - start) / 1e3)
        g[f"{kind} busy ms"].append(sum(k["dur"] for k in ks) / 1e3)
        g[f"{kind} kernels"].append(len(ks))
        first_kernel.setdefault(stream, min(ks, key=lambda k: k["ts"])["name"][:60])
        seq.append((e["ts"], stream, e["name"], start, end, len(ks), sum(k["dur"] for k in ks)))
    per_thread: dict[str, dict] = {
        f"stream {st}": {"launches": {k: _pcts(v) for k, v in g.items()}, "first_kernel": first_kernel[st]}
        for st, g in per_stream.items()
    }
    calls: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for e in runtime:
        calls[threads.get(e.get("tid"), f"tid {e.get('tid')}")][e["name"]] += e["dur"] / 1e3
    for t, c in calls.items():
        per_thread[t] = {"launches": {}, "runtime_ms": dict(sorted(c.items(), key=lambda kv: -kv[1])[:8])}
    out: dict = {"threads": per_thread}
    if sequence and seq:
        seq.sort()
        t0 = seq[0][0]
        out["launches"] = [
            dict(thread=n, call=c, host_ms=(h - t0) / 1e3, gpu_start_ms=(s - t0) / 1e3, gpu_end_ms=(e - t0) / 1e3,
                 kernels=k, busy_ms=b / 1e3)
            for h, n, c, s, e, k, b in seq[:sequence]
        ]  # fmt: skip
    if kernels:
        t0 = min(k["ts"] for k in kernels)
        t1 = max(k["ts"] + k["dur"] for k in kernels)
        spans = [(k["ts"], k["ts"] + k["dur"]) for k in kernels]
        by_stream: dict[int, list] = defaultdict(list)
        for k in kernels:
            by_stream[k.get("args", {}).get("stream", -1)].append((k["ts"], k["ts"] + k["dur"]))
        # time with n streams running a kernel at once, from the streams' own busy intervals
        edges = []
        for iv in by_stream.values():
            merged: list[list[float]] = []
            for s, e in sorted(iv):
                if merged and s <= merged[-1][1]:
                    merged[-1][1] = max(merged[-1][1], e)
                else:
                    merged.append([s, e])
            for s, e in merged:
                edges += [(s, 1), (e, -1)]
        edges.sort()
        level, last, at_once = 0, edges[0][0], defaultdict(float)
        for t, d in edges:
            at_once[level] += t - last
            level, last = level + d, t
        out["window_ms"] = (t1 - t0) / 1e3
        out["gpu_busy"] = _union(spans) / (t1 - t0)
        out["streams_at_once"] = {n: v / (t1 - t0) for n, v in sorted(at_once.items())}
        out["stream_busy"] = {s: _union(iv) / (t1 - t0) for s, iv in by_stream.items()}
    return out


def print_timeline(res: dict) -> None:
    if res.get("launches"):
        print(
            f"{'thread':18} {'call':16} {'host':>8} {'gpu start':>9} {'gpu end':>8} {'kernels':>7} {'busy':>7}"
        )
        for r in res["launches"]:
            print(
                f"{r['thread']:18} {r['call']:16} {r['host_ms']:8.3f} {r['gpu_start_ms']:9.3f} "
                f"{r['gpu_end_ms']:8.3f} {r['kernels']:7d} {r['busy_ms']:7.3f}"
            )
    if "window_ms" in res:
        at_once = ", ".join(f"{n}: {v:.2f}" for n, v in res["streams_at_once"].items())
        print(
            f"window {res['window_ms']:.1f} ms, GPU running a kernel {res['gpu_busy']:.2f}; streams at once {at_once}"
        )
    print(f"{'thread':22} {'what':18} {'n':>5} {'p50':>8} {'p90':>8} {'max':>8}")
    for name, t in res["threads"].items():
        for k, p in t["launches"].items():
            if p:
                print(f"{name:22} {k:18} {p['n']:>5} {p['p50']:>8.3f} {p['p90']:>8.3f} {p['max']:>8.3f}")
        if "first_kernel" in t:
            print(f"{name:22} first kernel: {t['first_kernel']}")
        if t.get("runtime_ms"):
            calls = ", ".join(f"{k} {v:.1f}" for k, v in list(t["runtime_ms"].items())[:4])
            print(f"{name:22} runtime ms: {calls}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--threads", required=True, help="JSON {native thread id: name}")
    ap.add_argument("--sequence", type=int, default=0, help="list the first N launches in host order")
    args = ap.parse_args(argv)
    threads = {int(k): v for k, v in json.loads(Path(args.threads).read_text()).items()}
    res = timeline(_load(Path(args.trace)), threads, args.sequence)
    print_timeline(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
