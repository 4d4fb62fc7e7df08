"""A load level's GPU timeline: `omni-rt bench --load N`, with a profiled window in the middle of it.

    PYTHONUNBUFFERED=1 python scripts/gpu_load_profile.py --out $OUT/load_profile -- --load 64 \
        --load-seconds 12 --reference off --set stall_timeout_s=30
    python scripts/gpu_load_profile.py --device-cpu --out /tmp/lp -- --preset tiny --device cpu --load 2 \
        --load-seconds 3 --reference off          # the logic only

Runs `omni_rt.bench.main` with the arguments after `--`. When a level's warm-up round ends, a thread waits
`--after` seconds (the conversations have started by then) and records `--window` seconds with
`torch.profiler` (CUDA activity: every thread's runtime calls and the kernels they launched). Then
`scripts/gpu_timeline.py` reads the trace: per stage thread (Thinker, Talker, Code2Wav) the wait from
each launch to its first kernel, the span and busy time of its kernels, and its host time in runtime calls.
Writes `timeline.json` (that), `threads.json` and, with `--keep-trace`, `trace.json.gz` under --out. Only
the first level is profiled.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import shutil
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_timeline import print_timeline, timeline  # noqa: E402

import omni_rt.bench as bench  # noqa: E402
import omni_rt.bench_load as bench_load  # noqa: E402


def stage_threads() -> dict[int, str]:
    return {t.native_id: t.name for t in threading.enumerate() if t.name.startswith("omni-rt-")}


async def profile_window(after: float, window: float, cuda: bool, res: dict) -> None:
    """Record `window` seconds from `after` seconds on, on the event loop's thread (the main thread:
    kineto wants to be started where it was registered)."""
    from torch.profiler import ProfilerActivity, profile

    await asyncio.sleep(after)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    res["threads"] = stage_threads()
    prof = profile(activities=activities)
    prof.start()
    await asyncio.sleep(window)
    prof.stop()  # the trace is written after the run: exporting here would hold the level's event loop
    res["prof"] = prof


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="load_profile")
    ap.add_argument("--after", type=float, default=8.0, help="seconds into the level before the window")
    ap.add_argument("--window", type=float, default=0.6, help="seconds profiled")
    ap.add_argument("--device-cpu", action="store_true", help="no CUDA activity (a logic check on the CPU)")
    ap.add_argument("--keep-trace", action="store_true")
    args = ap.parse_args(own)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    original = bench_load.warm_up
    res: dict = {}
    tasks: list = []

    async def warm_up(*a, **kw):
        await original(*a, **kw)
        if not tasks:  # the first level's conversations start now
            tasks.append(
                asyncio.ensure_future(profile_window(args.after, args.window, not args.device_cpu, res))
            )

    bench_load.warm_up = warm_up
    rc = bench.main(rest + ["--json", str(out / "bench.json"), "--load-png", ""])
    if "prof" not in res:
        print("no window was profiled (the level ended first?)", file=sys.stderr)
        return rc or 1
    trace = out / "trace.json"
    res["prof"].export_chrome_trace(str(trace))
    with open(trace) as f:
        events = json.load(f)["traceEvents"]
    tl = timeline(events, res["threads"])
    (out / "timeline.json").write_text(json.dumps(tl, indent=1))
    (out / "threads.json").write_text(json.dumps(res["threads"]))
    if args.keep_trace:
        with open(trace, "rb") as src, gzip.open(str(trace) + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
    trace.unlink()
    print_timeline(tl)
    return rc


if __name__ == "__main__":
    sys.exit(main())
