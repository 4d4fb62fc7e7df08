"""Do fresh engines stop with programmatic dependent launches on, and not without? One GPU call.

    PYTHONUNBUFFERED=1 python scripts/gpu_stall_ab.py --out $OUT --budget-s 540
    python scripts/gpu_stall_ab.py --runs 2 --out /tmp/ab -- --preset tiny --device cpu --load-seconds 3

On 2026-12-02 three of four fresh `omni-rt bench` processes on an H200 stopped within seconds of their
first requests: the GPU 100 % busy, every stage thread waiting on a read-back (docs/performance.md).
The only kernels of ours that wait on another kernel are the code-predictor frame's programmatic
dependent launches (`EngineSettings.programmatic_launch`, off by default since). This runs short bench
processes one after another, alternating the setting (off first), each a fresh process (a stop is not
recoverable in-process) with a stall watch of `--stall-s`: the bench exits 3 when its engine stalls
(`bench_output.exit_if_stalled`). Per run: the setting, the exit status, the wall time, the stall's
message and its log's tail; a table last, one JSON in --out (the device returns few files). Runs start
only while the budget leaves room for one more.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

# the load protocol only (--set reaches its engine; the stops came at a fresh engine's first requests)
BENCH = [
    sys.executable,
    "-m",
    "omni_rt.bench",
    "--reference",
    "off",
    "--load",
    "8,32",
    "--load-seconds",
    "20",
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="stall_ab")
    ap.add_argument("--budget-s", type=float, default=540.0, help="wall time for all runs")
    ap.add_argument("--run-s", type=float, default=150.0, help="a run's limit (and the room it needs)")
    ap.add_argument("--stall-s", type=float, default=20.0, help="the runs' stall_timeout_s")
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument(
        "bench_args", nargs="*", help="more bench arguments, after --, e.g. --preset tiny --device cpu"
    )
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0, runs = time.perf_counter(), []
    for i in range(args.runs):
        if time.perf_counter() - t0 + args.run_s > args.budget_s:
            break
        pdl = i % 2 == 1
        json_path = Path(f"/tmp/stall_ab_run{i}.json")
        sets = [
            "--set",
            f"stall_timeout_s={args.stall_s}",
            "--set",
            f"programmatic_launch={str(pdl).lower()}",
        ]
        files = [
            "--json",
            str(json_path),
            "--png",
            f"/tmp/stall_ab_{i}.png",
            "--load-png",
            f"/tmp/stall_ab_load{i}.png",
        ]
        cmd = BENCH + sets + args.bench_args + files
        t = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.run_s)
            code, log = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            code, log = (
                "timeout",
                (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace"),
            )
        wall = time.perf_counter() - t
        stall = None
        if json_path.exists():
            stall = json.loads(json_path.read_text())["meta"].get("stall")
        runs.append(
            dict(
                run=i,
                programmatic_launch=pdl,
                exit=code,
                wall_s=round(wall, 1),
                stall=stall,
                log_tail=log[-12_000:],
            )
        )
        print(f"run {i}: programmatic_launch={pdl} exit={code} {wall:.0f} s {stall or ''}", flush=True)
    (out / "stall_ab.json").write_text(json.dumps(runs, indent=1))
    print(f"{'run':>3} {'pdl':>5} {'exit':>7} {'wall s':>7}  stall")
    for r in runs:
        print(
            f"{r['run']:>3} {str(r['programmatic_launch']):>5} {str(r['exit']):>7} {r['wall_s']:>7}  {r['stall'] or ''}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
