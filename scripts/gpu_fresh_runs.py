"""`omni-rt bench` runs in fresh processes, one per settings variant in turn, for one GPU call.

    PYTHONUNBUFFERED=1 python scripts/gpu_fresh_runs.py --out $OUT --budget-s 540 \
        --variants '{"served": {}, "lead off": {"urgent_text_lead": null}}' -- --load 32,64 --load-trace
    python scripts/gpu_fresh_runs.py --runs 2 --out /tmp/fr -- --preset tiny --device cpu --load 2 --load-seconds 3

Why fresh processes: on 2026-12-02 5 of 13 bench processes on an H200 stopped (the GPU busy, every
stage thread waiting on a read-back; docs/performance.md), with programmatic launches on and off, and a
stopped device is not recoverable in-process. `bench --load-variants` in one process loses every variant
after a stop; here a stop costs one run. Each run has a stall watch of `--stall-s` (the bench then exits 3,
`bench_output.exit_if_stalled`, with the Python stacks and, where py-spy is installed, the native ones in
its log). Per run: the variant, the exit status, the wall time, the stall's message, the bench's JSON
(gzipped into --out) and its log's tail; a table last and one JSON in --out. Runs start only while the
budget leaves room for one more (`--run-s`).
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
import time
from pathlib import Path

# the load protocol by default (the stops came at a fresh engine's first requests under load)
BENCH = [sys.executable, "-m", "omni_rt.bench", "--reference", "off", "--rows", "none"]
DEFAULT_BENCH_ARGS = ["--load", "8,32", "--load-seconds", "20"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="fresh_runs")
    ap.add_argument("--budget-s", type=float, default=540.0, help="wall time for all runs")
    ap.add_argument("--run-s", type=float, default=150.0, help="a run's limit (and the room it needs)")
    ap.add_argument("--stall-s", type=float, default=20.0, help="the runs' stall_timeout_s")
    ap.add_argument("--runs", type=int, default=6, help="at most this many runs, the variants in turn")
    ap.add_argument(
        "--variants",
        default='{"served": {}}',
        help='JSON {"name": {EngineSettings field: value}}: each run takes the next (--set for each field)',
    )
    ap.add_argument(
        "bench_args", nargs="*", help="bench arguments, after -- (default: --load 8,32 --load-seconds 20)"
    )
    args = ap.parse_args(argv)
    variants = json.loads(args.variants)
    if (
        not isinstance(variants, dict)
        or not variants
        or not all(isinstance(v, dict) for v in variants.values())
    ):
        ap.error("--variants takes a JSON object of objects")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = list(variants)
    t0, runs = time.perf_counter(), []
    for i in range(args.runs):
        if time.perf_counter() - t0 + args.run_s > args.budget_s:
            break
        name = names[i % len(names)]
        sets = ["--set", f"stall_timeout_s={args.stall_s}"]
        for key, value in variants[name].items():
            sets += ["--set", f"{key}={json.dumps(value)}"]
        json_path = Path(f"/tmp/fresh_run{i}.json")
        json_path.unlink(missing_ok=True)
        files = [
            "--json",
            str(json_path),
            "--png",
            f"/tmp/fresh_run{i}.png",
            "--load-png",
            f"/tmp/fresh_load{i}.png",
        ]
        cmd = BENCH + sets + (args.bench_args or DEFAULT_BENCH_ARGS) + files
        log_path = out / f"run{i}.log"
        t = time.perf_counter()
        with log_path.open("w") as log:  # a file, not a pipe: a run killed at its limit keeps its log
            try:
                code = subprocess.run(
                    cmd, stdout=log, stderr=subprocess.STDOUT, timeout=args.run_s
                ).returncode
            except subprocess.TimeoutExpired:
                code = "timeout"
        wall = time.perf_counter() - t
        stall = None
        if json_path.exists():
            result = json.loads(json_path.read_text())
            stall = result["meta"].get("stall")
            with gzip.open(out / f"run{i}.json.gz", "wt") as f:
                json.dump(result, f)
        runs.append(
            dict(run=i, variant=name, settings=variants[name], exit=code, wall_s=round(wall, 1), stall=stall)
        )
        print(f"run {i}: {name} exit={code} {wall:.0f} s {stall or ''}", flush=True)
        print(log_path.read_text()[-3000:], flush=True)  # the run's tables
    (out / "fresh_runs.json").write_text(json.dumps(runs, indent=1))
    print(f"{'run':>3} {'variant':>16} {'exit':>7} {'wall s':>7}  stall")
    for r in runs:
        print(f"{r['run']:>3} {r['variant']:>16} {str(r['exit']):>7} {r['wall_s']:>7}  {r['stall'] or ''}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
