"""Do CUDA graphs captured on one stream share cuBLAS's workspace when two threads replay them at once?

    PYTHONUNBUFFERED=1 python scripts/gpu_graph_streams.py --out $OUT/graph_streams.json

Why: 5 of 13 fresh bench processes on an H200 stopped under load on 2026-12-02, with the Thinker and
the Talker threads both inside a read-back (`cuMemcpyDtoHAsync`, py-spy's native stacks) and the GPU
busy. PyTorch keys cuBLAS's workspace by (handle, current stream); a graph keeps the workspace address it
was captured with. `graphs.Graphed` captured every graph on a fresh `torch.cuda.Stream()`, which comes from
a pool of 32 per priority, all from the engine's loading thread (one handle): with hundreds of graphs, a
Thinker graph and a Talker graph share a workspace, and the stage threads replay them at the same time.
A GEMM kernel that keeps split-K partials or stream-K fix-up flags in its workspace is then corrupted by
the other, or waits forever for a flag the other overwrote.

Each mode runs in a fresh process (a stopped device does not come back in-process) with a time limit:
- `shared`: two stages' GEMM chains (the real config's shapes at batches 1 and 32) captured on one stream;
- `pooled`: captured as graphs.Graphed did (a fresh pooled stream each, 40 graphs per stage);
- `own`: each stage's graphs captured on that stage's own stream (the fix);
- `omni_rt`: captured through omni_rt's own path (`stage_stream`, `GraphPool`, `capture_or_eager`).
Then two threads replay their stage's graphs on their own streams for --seconds, each replay checked
bit-exact against the graph's replay alone. Per mode: replays, mismatches, a stop (no progress for 20 s).
Also the GEMM kernels cuBLAS picked for these shapes (the profiler's names: splitK / stream-K ones use the
workspace). A table last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omni_rt.pipeline.graphs import GraphPool, capture_or_eager  # noqa: E402
from omni_rt.pipeline.stage_device import stage_stream  # noqa: E402

# (K, N) of the projections a decode step multiplies, from the real config (qwen3_omni_30b_a3b_config.json)
THINKER = [(2048, 4096), (2048, 512), (2048, 512), (4096, 2048), (2048, 128), (2048, 152064)]
TALKER = [(1024, 2048), (1024, 256), (2048, 1024), (1024, 1536), (768, 1024), (1024, 3072)]
PREDICTOR = [(1024, 2048), (1024, 1024), (2048, 1024), (1024, 6144), (3072, 1024), (1024, 2048)]
STAGES = {"thinker": THINKER, "talker": TALKER + PREDICTOR}
MODES = ("shared", "pooled", "own", "omni_rt")


def weights(shapes, dev):
    return [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for k, n in shapes]


def chain(shapes, m: int, dev, ws):
    xs = [torch.randn(m, k, device=dev, dtype=torch.bfloat16) for k, _ in shapes]

    def fn():
        return [x @ w.t() for x, w in zip(xs, ws, strict=True)]

    return fn


def capture(fn, stream):
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        out = fn()
    return g, out


def run_mode(mode: str, seconds: float, n_graphs: int = 40) -> dict:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    if mode == "omni_rt":
        stage_streams = {s: stage_stream(dev, p) for s, p in (("thinker", 0), ("talker", -1))}
    else:
        stage_streams = {s: torch.cuda.Stream(priority=p) for s, p in (("thinker", 0), ("talker", -1))}
    pools = {s: GraphPool(stage_streams[s]) for s in STAGES}
    shared = torch.cuda.Stream()
    graphs = {s: [] for s in STAGES}
    alive = []
    for stage, shapes in STAGES.items():  # one stage's graphs after the other's, as the runners are built
        ws = weights(shapes, dev)
        for i in range(n_graphs):
            fn = chain(shapes, (1, 8, 32, 64)[i % 4], dev, ws)
            if mode == "omni_rt":
                g = capture_or_eager(lambda _x, fn=fn: fn(), (torch.zeros(1, device=dev),), pools[stage])
                graphs[stage].append((g.graph, g.static_outputs))
                alive.append((fn, ws))
                continue
            if mode == "shared":
                stream = shared
            elif mode == "pooled":
                stream = torch.cuda.Stream()
            else:
                stream = stage_streams[stage]
            g, out = capture(fn, stream)
            graphs[stage].append((g, out))
            alive.append((fn, ws))  # a graph holds raw pointers: its inputs and weights must outlive it
    torch.cuda.synchronize()
    # each graph's outputs replayed alone: the reference
    refs = {}
    for stage, gs in graphs.items():
        with torch.cuda.stream(stage_streams[stage]):
            for j, (g, out) in enumerate(gs):
                g.replay()
                refs[(stage, j)] = [o.clone() for o in out]
        torch.cuda.synchronize()
    counts = {s: {"replays": 0, "mismatches": 0} for s in STAGES}
    last = {"t": time.perf_counter()}
    stop = threading.Event()

    def worker(stage):
        gs = graphs[stage]
        with torch.cuda.stream(stage_streams[stage]):
            j = 0
            while not stop.is_set():
                g, out = gs[j % len(gs)]
                g.replay()
                ok = all(torch.equal(o, r) for o, r in zip(out, refs[(stage, j % len(gs))], strict=True))
                counts[stage]["replays"] += 1
                counts[stage]["mismatches"] += 0 if ok else 1
                last["t"] = time.perf_counter()
                j += 1

    threads = [threading.Thread(target=worker, args=(s,), daemon=True) for s in STAGES]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    stopped = False
    while time.perf_counter() - t0 < seconds:
        time.sleep(0.5)
        if time.perf_counter() - last["t"] > 20:
            stopped = True
            break
    stop.set()
    result = dict(mode=mode, seconds=round(time.perf_counter() - t0, 1), stopped=stopped, counts=counts)
    if stopped:  # the threads are stuck in the device: report and leave without joining them
        print(json.dumps(result), flush=True)
        os._exit(0)
    for t in threads:
        t.join()
    return result


def kernel_names() -> dict:
    dev = torch.device("cuda")
    names: dict[str, list[str]] = {}
    for stage, shapes in STAGES.items():
        ws = weights(shapes, dev)
        for m in (1, 32):
            fn = chain(shapes, m, dev, ws)
            fn()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
            names[f"{stage} m={m}"] = sorted({e.name for e in prof.events() if e.device_type.name == "CUDA"})
    return names


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="graph_streams.json")
    ap.add_argument("--seconds", type=float, default=25.0)
    ap.add_argument("--graphs", type=int, default=40, help="graphs per stage")
    ap.add_argument("--modes", default=",".join(MODES), help="the modes to run, comma-separated")
    ap.add_argument("--mode", choices=MODES, help="run one mode in this process (the parent's child)")
    args = ap.parse_args(argv)
    if args.mode:
        print(json.dumps(run_mode(args.mode, args.seconds, args.graphs)), flush=True)
        return 0
    results = {"kernels": kernel_names(), "modes": []}
    for name, ks in results["kernels"].items():
        print(name, ks, flush=True)
    for mode in args.modes.split(","):
        cmd = [
            sys.executable,
            __file__,
            "--mode",
            mode,
            "--seconds",
            str(args.seconds),
            "--graphs",
            str(args.graphs),
        ]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.seconds + 120)
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
            r = json.loads(lines[-1]) if lines else dict(mode=mode, error=p.stderr[-2000:])
        except subprocess.TimeoutExpired:
            r = dict(mode=mode, stopped=True, error="timeout")
        results["modes"].append(r)
        print(json.dumps(r), flush=True)
        Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"{'mode':>8} {'stopped':>8} {'thinker replays/bad':>22} {'talker replays/bad':>22}")
    for r in results["modes"]:
        c = r.get("counts", {})
        cell = {s: f"{c[s]['replays']}/{c[s]['mismatches']}" if s in c else "-" for s in STAGES}
        print(f"{r['mode']:>8} {str(r.get('stopped')):>8} {cell['thinker']:>22} {cell['talker']:>22}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
