"""Where a served request's host time goes: the CUDA runtime calls of every stage thread, profiled.

    PYTHONUNBUFFERED=1 python scripts/gpu_request_profile.py --out $OUT [--set early_start=true ...]
    python scripts/gpu_request_profile.py --preset tiny --device cpu --out /tmp/prof   # the logic only

The served configuration at real shapes (random bf16 weights, default `Sampling()`, seeded) warms up
on a few requests, then `torch.profiler` (CPU and CUDA activity, which includes the CUDA runtime API
calls of every thread) records `--requests` single requests through the public Session. Printed: per
request TTFA; the runtime calls by host time (a `cudaStreamSynchronize`, `cudaMemcpy*` or
`cudaHostAlloc` on a stage thread is a wait that a sync-free step would not have), per thread; and the
profiled ranges of the pipeline's stage calls. The Talker's prompt prefix took 14.6 ms of host time per
call on an H200 (d6ed38d) though it replays one graph: this says on what. Writes `profile.json` (the
tables) and `trace.json.gz` (Chrome trace) under --out.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import shutil
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import omni_rt  # noqa: E402
from omni_rt.bench import chat_prompt  # noqa: E402
from omni_rt.bench_measure import timed_request  # noqa: E402
from omni_rt.bench_plan import parse_sets  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_timeline import print_timeline, timeline  # noqa: E402

RUNTIME_PREFIXES = ("cuda", "cu")  # runtime and driver API events (cudaLaunchKernel, cuLaunchKernelEx, ...)


async def serve(engine, prompt: list[int], n: int, seed: int) -> list[float]:
    ttfa = []
    async with engine.session() as s:
        for i in range(n):
            sample = await timed_request(s, prompt, 64, 64, omni_rt.Sampling(seed=seed + i))
            ttfa.append(sample.ttfa_ms)
    return ttfa


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-omni-30b-a3b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--max-sessions", type=int, default=64, help="engine slots (the load protocol's: 64)")
    ap.add_argument("--out", default="request_profile")
    ap.add_argument(
        "--sequence", type=int, default=40, help="the first N stage launches listed in host order"
    )
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="an engine setting over the served ones (repeatable), as omni-rt bench's: early_start=true",
    )  # fmt: skip
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kw = dict(max_sessions=args.max_sessions, max_context=512, max_talker_context=512) | parse_sets(args.set)
    engine = omni_rt.Engine.load(args.preset, random_weights=True, device=args.device, **kw)
    prompt = chat_prompt(20, 24, seed=0, ids=engine.cfg.ids)

    async def run() -> dict:
        async with engine:
            warm = await serve(engine, prompt, args.warmup, 100)
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
            t0 = time.perf_counter()
            threads = {t.native_id: t.name for t in threading.enumerate() if t.name.startswith("omni-rt-")}
            with profile(activities=activities) as prof:
                ttfa = await serve(engine, prompt, args.requests, 200)
            wall = time.perf_counter() - t0
            steps = [s for s in engine.pipeline.steps if s.t_start >= t0]
        return dict(warm=warm, ttfa=ttfa, wall=wall, prof=prof, steps=steps, threads=threads)

    res = asyncio.run(run())
    prof = res.pop("prof")
    by_name: dict[str, list[float]] = defaultdict(list)
    by_thread: dict[tuple[int, str], float] = defaultdict(float)
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CPU or not ev.name.startswith(RUNTIME_PREFIXES):
            continue
        us = ev.time_range.elapsed_us()  # host time of the call
        by_name[ev.name].append(us)
        by_thread[(ev.thread, ev.name)] += us
    calls = sorted(
        (
            {"call": k, "count": len(v), "total_ms": sum(v) / 1e3, "max_ms": max(v) / 1e3}
            for k, v in by_name.items()
        ),
        key=lambda r: -r["total_ms"],
    )
    threads = sorted(
        ({"thread": t, "call": k, "total_ms": v / 1e3} for (t, k), v in by_thread.items()),
        key=lambda r: -r["total_ms"],
    )
    stage = defaultdict(list)
    for s in res["steps"]:
        stage[f"{s.stage}.{s.kind}"].append((s.t_end - s.t_start) * 1e3)
    stages = {k: {"count": len(v), "median_ms": sorted(v)[len(v) // 2]} for k, v in stage.items()}
    # per request: does the Talker's prefix end before the Thinker's first token (the prefill's end)?
    # If not, its last prompt position waits for it, and first audio with it (6.2 ms at the load
    # protocol's level 1 on an H200, d6ed38d)
    first: dict[str, dict[str, tuple[float, float]]] = defaultdict(dict)
    for s in res["steps"]:
        for rid in s.request_ids:
            first[rid].setdefault(f"{s.stage}.{s.kind}", (s.t_start, s.t_end))
    overrun = [
        dict(request=rid, prefix_end_after_prefill_ms=(k["talker.prefix"][1] - k["thinker.prefill"][1]) * 1e3,
             last_start_after_prefill_ms=(k["talker.last"][0] - k["thinker.prefill"][1]) * 1e3)
        for rid, k in first.items() if {"talker.prefix", "thinker.prefill", "talker.last"} <= k.keys()
    ]  # fmt: skip
    report = {"ttfa_ms": res["ttfa"], "warmup_ttfa_ms": res["warm"], "wall_s": res["wall"],
              "runtime_calls": calls[:40], "per_thread": threads[:40], "stage_calls": stages,
              "prefix_vs_first_token": overrun}  # fmt: skip
    (out / "profile.json").write_text(json.dumps(report, indent=1))
    trace = out / "trace.json"
    prof.export_chrome_trace(str(trace))
    with open(trace) as f:  # the first request's path to its first audio, launch by launch (gpu_timeline.py)
        tl = timeline(json.load(f)["traceEvents"], res["threads"], sequence=args.sequence)
    (out / "timeline.json").write_text(json.dumps(tl, indent=1))
    print_timeline(tl)
    with open(trace, "rb") as src, gzip.open(str(trace) + ".gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    trace.unlink()
    print(f"TTFA ms (profiled, so slower): {[round(x, 1) for x in res['ttfa']]}")
    print(f"{'stage call':24} {'n':>5} {'median ms':>10}")
    for k, v in sorted(stages.items()):
        print(f"{k:24} {v['count']:>5} {v['median_ms']:>10.2f}")
    for o in overrun:
        print(
            f"{o['request']}: prefix ends {o['prefix_end_after_prefill_ms']:+.1f} ms after the first token, "
            f"the last position starts {o['last_start_after_prefill_ms']:+.1f} ms after it"
        )
    print(f"{'runtime call':36} {'n':>6} {'total ms':>9} {'max ms':>8}")
    for r in calls[:15]:
        print(f"{r['call'][:36]:36} {r['count']:>6} {r['total_ms']:>9.2f} {r['max_ms']:>8.2f}")
    print(f"{'thread':>16} {'runtime call':36} {'total ms':>9}")
    for r in threads[:15]:
        print(f"{r['thread']:>16} {r['call'][:36]:36} {r['total_ms']:>9.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
