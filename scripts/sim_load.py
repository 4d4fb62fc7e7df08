"""The load protocol on a modelled GPU: the real scheduler, Session and `omni-rt bench --load` client, with
fake stages whose calls occupy one shared, simulated GPU for as long as the H200's measured costs say.

    python scripts/sim_load.py --load 64 --load-seconds 20 --variants '{"served": {}, "flat out": {"max_text_lead": null}}'

What it is for: the pacing policies (text lead, due lead, the Thinker's yield, chunk plans) decide how many
calls each stage makes and how many rows each carries, and so how much of the GPU the Thinker takes from
the Talker and Code2Wav. Those dynamics are the scheduler's, and run here as they run on the card; only
the calls' durations are a model. So it ranks policies before device time is spent on them, and says which
variants a device run should A/B. It is not a measurement: every figure it prints is labelled simulated,
and none goes in docs/performance.md's tables.

The model (`COSTS`, solo GPU milliseconds by rows; from docs/performance.md's H200 entries):
- Thinker decode: launch-bound floor + the bytes of the experts the batch touches (top-8 of 128 per row:
  1 - (120/128)^rows of 58 GB); prefill ~21 ms for the protocol's 57-id prompt.
- Talker step: floor + its experts (top-6 of 128, 6 GB); the code-predictor frame 2.1 ms + per row;
  Code2Wav 1.4 ms + per row-frame.
- Sharing (`SharedGpu`): calls in flight share the GPU by weight (`--capacity` 1.6: launch-bound
  streams fill each other's gaps). A Thinker call weighs 2, the others 1. Calibrated on the 95024cb
  load run's step medians (small calls 1.1-1.5x slower than alone at 16-64 conversations, the Thinker's
  decode ~1.05x); beside a Thinker-like graph running back to back a 1-frame Code2Wav step ran 3.5x slower.
- Host time: each call also takes `HOST_MS` outside the GPU (the launch, the read-back), of it
  `LAUNCH_MS` holding one driver lock that all stage threads share.

Calibration (docs/performance.md, 2026-12-05): at 16 conversations the model's calls and TTFA are within
~15 % of the H200's (95024cb); at 64 `--cost-scale 1.3` brings each part of the path to the first audio
within ~20 % of the measured one, yet no reply plays late unless the whole process stalls
(`--stall-every`: full collections over objects of its own).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # load_trace

from omni_rt.pipeline.fake import FakeCode2Wav, FakeTalker, FakeThinker, FakeTimings  # noqa: E402


def coverage(rows: int, top_k: int, experts: int = 128) -> float:
    """Fraction of a MoE layer's experts that `rows` tokens route to (each picks top_k of `experts`)."""
    return 1.0 - ((experts - top_k) / experts) ** max(rows, 0)


# solo GPU ms of each call, by the rows it carries (and frames, for Code2Wav)
COSTS = {
    "decode": lambda n, f: 3.3 + 14.5 * coverage(n, 8),
    "prefill": lambda n, f: 20.0 + 1.0 * (n - 1),
    "piece": lambda n, f: 5.0,
    "prefix": lambda n, f: 6.0 + 0.5 * (n - 1),
    "last": lambda n, f: 2.6 + 0.6 * coverage(n, 6),  # the last prompt position (frame 0 is `predict`)
    "step": lambda n, f: 2.9 + 1.44 * coverage(n, 6),
    "predict": lambda n, f: 2.1 + 0.14 * min(n, 8) + 0.03 * max(n - 8, 0),
    "chunk": lambda n, f: 1.4 + 0.06 * f,
    "queue": lambda n, f: 0.0,
}
WEIGHTS = {"decode": 2.0, "prefill": 2.0, "piece": 2.0}  # the rest 1
# host ms of each call outside the GPU (launch, read-back, bookkeeping): a single request's host step
# medians less the graph's GPU time (2026-12-04 third session: decode 6.09 vs 4.2, frame 3.79 vs 2.2,
# 1-frame chunk 4.22 vs 1.6, Talker step 3.13 vs 2.9, prefill 21.3 vs 20.3)
HOST_MS = {"decode": 1.9, "prefill": 1.0, "piece": 0.5, "prefix": 0.5, "last": 1.5, "step": 0.25,
           "predict": 1.6, "chunk": 2.6, "queue": 0.0}  # fmt: skip
# of HOST_MS, the ms a call holds the driver's lock (a graph launch: ~2.4 us a kernel node; the Thinker's
# decode 1149 nodes took ~2.8 ms of host time a launch at 64 conversations); its read-back takes the lock
# again for READBACK_MS, waiting while another thread launches
LAUNCH_MS = {"decode": 2.8, "prefill": 2.9, "piece": 2.9, "prefix": 1.4, "last": 1.0, "step": 1.1,
             "predict": 1.0, "chunk": 1.0, "queue": 0.0}  # fmt: skip
READBACK_MS = 0.03


class SharedGpu:
    """Processor sharing: each call in flight progresses at min(1, capacity * weight / total weight) of
    its solo speed; a call returns when its solo time is done."""

    def __init__(self, capacity: float = 1.1) -> None:
        self.capacity = capacity
        self._cv = threading.Condition()
        self._jobs: dict[int, list[float]] = {}  # id -> [remaining solo seconds, weight]
        self._t = time.perf_counter()
        self._next = 0
        self.busy_s = 0.0  # time with at least one call in flight

    def _rates(self) -> dict[int, float]:
        total = sum(w for _, w in self._jobs.values())
        return {j: min(1.0, self.capacity * w / total) for j, (_, w) in self._jobs.items()}

    def _advance(self) -> None:
        now = time.perf_counter()
        dt, self._t = now - self._t, now
        if self._jobs:
            self.busy_s += dt
        for j, r in self._rates().items():
            self._jobs[j][0] -= r * dt

    def run(self, seconds: float, weight: float) -> None:
        with self._cv:
            self._advance()
            job, self._next = self._next, self._next + 1
            self._jobs[job] = [seconds, weight]
            self._cv.notify_all()
            while True:
                self._advance()
                left = self._jobs[job][0]
                if left <= 1e-6:
                    del self._jobs[job]
                    self._cv.notify_all()
                    return
                self._cv.wait(left / self._rates()[job])


class _Modelled:
    """Mixed into a fake stage: `work` runs the modelled cost of the call on the shared GPU."""

    gpu: SharedGpu
    host_scale: float
    cost_scale: float
    driver: threading.Lock | None  # the CUDA driver's context lock (None: not modelled)
    readback_holds: bool = False
    frames: int = 0  # the frames of the Code2Wav call being made

    def work(self, kind: str, seconds: float, reqs: list) -> None:  # noqa: ARG002 (the fake's own time)
        with self._lock:
            self.calls[kind] = self.calls.get(kind, 0) + 1
        cost = COSTS[kind](len(reqs), self.frames) * self.cost_scale / 1e3
        launch = LAUNCH_MS[kind] * self.host_scale / 1e3 if self.driver is not None else 0.0
        host = max(HOST_MS[kind] * self.host_scale / 1e3 - launch, 0.0)
        if host:
            time.sleep(host)
        if launch:
            with self.driver:  # the GPU starts on the first nodes while the rest are pushed
                time.sleep(launch)
        if self.readback_holds and self.driver is not None and cost > 0:
            with self.driver:  # a pageable read-back that waits for its stream inside the driver call
                if cost > launch:
                    self.gpu.run(cost - launch, WEIGHTS.get(kind, 1.0))
                time.sleep(READBACK_MS / 1e3)
            return
        if cost > launch:
            self.gpu.run(cost - launch, WEIGHTS.get(kind, 1.0))
        if self.driver is not None and cost > 0:
            with self.driver:
                time.sleep(READBACK_MS / 1e3)


class SimThinker(_Modelled, FakeThinker):
    pass


class SimTalker(_Modelled, FakeTalker):
    pass


class SimCode2Wav(_Modelled, FakeCode2Wav):
    def push(self, req, frames):
        self.frames = len(frames)
        return super().push(req, frames)

    def push_many(self, reqs, frames):
        self.frames = sum(len(f) for f in frames)
        return super().push_many(reqs, frames)


def sim_engine(settings: dict, gpu: SharedGpu, host_scale: float, cost_scale: float, driver_lock: bool,
               readback_holds: bool = False):  # fmt: skip
    import omni_rt
    from omni_rt.engine import Engine
    from omni_rt.model.config import preset
    from omni_rt.tokenizer import Tokenizer

    cfg = preset("tiny")
    t = FakeTimings()

    def stages(s):
        made = (SimThinker(t, cfg.ids, reply_len=1 << 30), SimTalker(t, cfg.ids), SimCode2Wav(t))
        driver = threading.Lock() if driver_lock else None
        for st in made:
            st.gpu, st.host_scale, st.cost_scale, st.driver = gpu, host_scale, cost_scale, driver
            st.readback_holds = readback_holds
        return made

    return Engine(cfg, Tokenizer.tiny(cfg.ids), stages, omni_rt.EngineSettings(**settings).for_device("cuda"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--load", default="64")
    ap.add_argument("--load-seconds", type=float, default=20.0)
    ap.add_argument("--variants", default='{"served": {}}', help="JSON: name -> EngineSettings overrides")
    ap.add_argument("--host-scale", type=float, default=1.0, help="times HOST_MS")
    ap.add_argument(
        "--cost-scale", type=float, default=1.0, help="times COSTS (a slower card, more pressure)"
    )
    ap.add_argument("--capacity", type=float, default=1.6)
    ap.add_argument(
        "--readback-holds",
        action="store_true",
        help="a read-back holds the driver's lock while it waits for its stream (a hypothesis)",
    )
    ap.add_argument(
        "--no-driver-lock", action="store_true", help="launches and read-backs do not exclude each other"
    )
    ap.add_argument(
        "--stall-every", type=float, default=0.0, help="s between forced full collections (0: none)"
    )
    ap.add_argument("--stall-objects", type=int, default=1_000_000, help="objects those collections walk")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()

    from load_trace import analyse, first_audio_path

    from omni_rt.bench import parse_args as bench_args
    from omni_rt.bench_load import (
        LoadPlan,
        format_load_table,
        load_prompt,
        load_settings,
        parse_levels,
        run_levels,
    )

    args = bench_args(
        ["--load", a.load, "--load-seconds", str(a.load_seconds), "--load-trace", "--reference", "off"]
    )
    levels = parse_levels(a.load)
    sizes = load_settings(args, levels, len(load_prompt(args)))
    plan = LoadPlan(text_tokens=args.text_tokens, frames=args.frames, prompt=load_prompt(args), speech=None,
                    sampling=args.load_sampling, seed=args.seed, voice=args.voice)  # fmt: skip
    if a.stall_every:
        _stall_thread(a.stall_every, a.stall_objects)
    results = {}
    for name, overrides in json.loads(a.variants).items():
        gpu = SharedGpu(a.capacity)
        engine = sim_engine(sizes | overrides, gpu, a.host_scale, a.cost_scale, not a.no_driver_lock,
                            a.readback_holds)  # fmt: skip
        t_start = time.perf_counter()
        rows = asyncio.run(run_levels(engine, levels, plan, args))
        wall = time.perf_counter() - t_start
        for row in rows:
            row["stages"] = analyse(row)["stages"]
            row["first_audio_path"] = first_audio_path(row)
            row.pop("trace", None)
            row.pop("per_reply", None)
        results[name] = {"rows": rows, "gpu_busy": round(gpu.busy_s / wall, 2), "wall_s": round(wall, 1)}
        print(f"[sim] {name}: {wall:.0f} s", file=sys.stderr, flush=True)
        print(format_load_table(rows), flush=True)
        for row in rows:
            print(
                f"  {row['conversations']}: "
                + ", ".join(
                    f"{k} {v['calls']} x {v['rows']:.1f} rows {v['p50_ms']:.1f} ms"
                    for k, v in row["stages"].items()
                )
            )
            print("    to first audio, ms p50 / p90: " + ", ".join(
                f"{k} {v['p50']:.1f}/{v['p90']:.1f}" for k, v in row["first_audio_path"].items()))  # fmt: skip
    if a.json:
        a.json.write_text(
            json.dumps(
                {
                    "simulated": True,
                    "costs": "scripts/sim_load.py COSTS",
                    **vars(a) | {"json": str(a.json)},
                    "results": results,
                },
                indent=1,
            )
        )
    print("\n(simulated: the scheduler's real policies on a modelled GPU; not a measurement)")
    for name, r in results.items():
        for row in r["rows"]:
            print(
                f"{name:28s} {row['conversations']:3d}  GPU busy {r['gpu_busy']:.2f}  late {row['late_replies']:3d}/{row['replies']:<3d} "
                f"TTFA p50/p95 {row['ttfa_ms']['p50']:.0f}/{row['ttfa_ms']['p95']:.0f} ms  "
                f"lateness p95 {row['lateness_ms']['p95']:.0f} ms"
            )
    return 0


def _stall_thread(every_s: float, objects: int) -> None:
    """A daemon thread that runs a full collection over `objects` live objects of its own every `every_s`
    seconds: the interpreter-lock stall of a full collection in a big process, on purpose."""
    import gc

    heap = [[i] for i in range(objects)]  # tracked objects: what a full collection walks

    def run() -> None:
        while True:
            time.sleep(every_s)
            t0 = time.perf_counter()
            gc.collect()
            print(f"[sim] stall: a full collection over {len(heap)} objects took "
                  f"{(time.perf_counter() - t0) * 1e3:.0f} ms", file=sys.stderr, flush=True)  # fmt: skip

    threading.Thread(target=run, daemon=True).start()


if __name__ == "__main__":
    sys.exit(main())
