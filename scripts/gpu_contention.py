"""What a Code2Wav chunk costs beside a busy GPU, and what would give it its time back.

    PYTHONUNBUFFERED=1 python3 scripts/gpu_contention.py --out $OUT/gpu_contention.json

Why: at 64 conversations on an H200 a Code2Wav call of 15 one-frame rows took ~39 ms in the pipeline,
against 2.45 ms for 16 rows alone (docs/performance.md, 2026-12-04, second session): its ~410 kernels run
beside the Thinker's decode and the Talker's steps. This script measures that in isolation, at the real
shapes (the `qwen3-omni-30b-a3b` Code2Wav with random bf16 weights and the served fused kernels), and
tries the levers one at a time:

- `alone`: the graphed Code2Wav step (rows x frames from `--shapes`), nothing else on the GPU;
- `beside`: the same while a background stream replays, back to back, a CUDA graph of bandwidth-bound
  GEMMs shaped like a Thinker decode step (`--bg-rows` rows of 2048 against `--bg-gb` GB of weights in
  64 MB slabs), at priority 0, the step at priority -1: the pipeline's arrangement today;
- `beside, step at priority P`: the step's stream at each priority of `--priorities` (torch clamps to
  the device's range, which it prints);
- `beside, background on N SMs`: the background stream from a CUDA green context of N SMs
  (`--green`), when this torch has `torch.cuda.green_contexts` and the driver supports it; the step on
  the default context. The background graph is captured on that stream.
Each figure is the median of `--reps` replays' GPU times (CUDA events around each replay on the step's
stream), with the background's own replay time beside it, so a lever's cost to the background shows too.
`--device cpu` checks the script's logic (no background, no green contexts).

First run on an H200 on 2026-12-04 (third session; docs/performance.md): beside the background a 1-frame
step took 5.5 ms against 1.57 alone, no stream priority changed it, a background on 100 SMs gave 3.8 ms.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omni_rt.model.code2wav import Code2Wav  # noqa: E402
from omni_rt.model.config import preset  # noqa: E402
from omni_rt.model.weights import init_random  # noqa: E402
from omni_rt.pipeline.graphs import capture  # noqa: E402


class Background:
    """A Thinker-decode-like load: one CUDA graph of GEMMs over distinct weight slabs, replayed back to back
    on its own stream by a host thread (at most 4 replays queued), until `stop()`."""

    SLAB = 64 * 2**20  # bytes per weight slab

    def __init__(self, dev: torch.device, rows: int, gb: float, stream: torch.cuda.Stream) -> None:
        cols = self.SLAB // (2048 * 2)
        slabs = max(1, int(gb * 2**30 // self.SLAB))
        self.stream = stream
        with torch.cuda.stream(stream):
            self.w = [torch.randn(2048, cols, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(slabs)]
            self.x = torch.randn(rows, 2048, device=dev, dtype=torch.bfloat16)
        torch.cuda.synchronize()
        self.graph = capture(lambda x: [x @ w for w in self.w], (self.x,), stream=stream)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.replay_ms: list[float] = []

    def _loop(self) -> None:
        queued: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        with torch.cuda.stream(self.stream):
            while not self._stop.is_set():
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                self.graph(self.x)
                e.record()
                queued.append((s, e))
                if len(queued) > 4:
                    s0, e0 = queued.pop(0)
                    e0.synchronize()
                    self.replay_ms.append(s0.elapsed_time(e0))
        for _, e0 in queued:
            e0.synchronize()

    def start(self) -> None:
        self.replay_ms.clear()
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def stop(self) -> float | None:
        """Stop; the median background replay time while it ran (ms)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return statistics.median(self.replay_ms) if self.replay_ms else None


def step_times(step, codes: torch.Tensor, stream, reps: int) -> float:
    """Median GPU time of `reps` replays of `step(codes)` on `stream` (CUDA events around each), in ms."""
    if codes.device.type != "cuda":
        t = time.perf_counter()
        for _ in range(reps):
            step(codes)
        return (time.perf_counter() - t) * 1e3 / reps
    out = []
    with torch.cuda.stream(stream):
        for _ in range(3):
            step(codes)
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            step(codes)
            e.record()
            e.synchronize()
            out.append(s.elapsed_time(e))
    return statistics.median(out)


def green_stream(num_sms: int, dev: torch.device):
    """A stream of a green context of `num_sms` SMs, with the context (kept alive by the caller); raises
    where this torch or driver has none. Two shapes of the API are tried: `GreenContext.create(...)` with
    a `Stream()` method (torch 2.13), and the constructor `GreenContext(num_sms=...)` (newer)."""
    from torch.cuda import green_contexts as gc

    cls = gc.GreenContext
    ctx = (
        cls.create(num_sms=num_sms, device_id=dev.index or 0)
        if hasattr(cls, "create")
        else cls(num_sms=num_sms)
    )
    if hasattr(ctx, "Stream"):
        return ctx.Stream(), ctx
    ctx.set_context()  # older shape: streams made while it is current belong to it
    try:
        return torch.cuda.Stream(device=dev), ctx
    finally:
        ctx.pop_context()


@torch.no_grad()
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-omni-30b-a3b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="gpu_contention.json")
    ap.add_argument("--shapes", default="1x1,16x1,4x16", help="Code2Wav steps, rows x frames")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--bg-rows", type=int, default=18)
    ap.add_argument("--bg-gb", type=float, default=8.0)
    ap.add_argument("--priorities", default="-2,-3,-5")
    ap.add_argument("--green", default="100,116,124", help="SMs of the background's green context")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    c2w = Code2Wav(preset(args.preset).code2wav).to(dev, dtype).eval().requires_grad_(False)
    init_random(c2w, seed=0)
    if cuda:
        from omni_rt.kernels import fused

        fused.install_all(c2w, enabled={"snake", "rmsnorm", "code2wav"})
    res: dict = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "rows": [],
    }
    if cuda:
        res["priority_range"] = list(torch.cuda.Stream.priority_range())
        print(f"{res['device']}, torch {torch.__version__}, stream priorities {res['priority_range']}")
    steps = {}
    for shape in args.shapes.split(","):
        rows, frames = (int(v) for v in shape.split("x"))
        state = c2w.new_state(rows)
        codes = torch.randint(0, c2w.cfg.codebook_size, (rows, c2w.cfg.num_quantizers, frames), device=dev)
        steps[shape] = (capture(lambda c, st=state: c2w.step(c, st), (codes,)), codes)

    def measure(label: str, stream, bg: Background | None) -> None:
        if bg is not None:
            bg.start()
        try:
            ms = {shape: step_times(step, codes, stream, args.reps) for shape, (step, codes) in steps.items()}
        finally:
            bg_ms = bg.stop() if bg is not None else None
        res["rows"].append(dict(setup=label, step_ms=ms, background_ms=bg_ms))
        cells = "  ".join(f"{s} {v:7.3f}" for s, v in ms.items())
        print(f"{label:34} {cells}  background {bg_ms if bg_ms is None else round(bg_ms, 3)} ms")

    step_stream = torch.cuda.Stream(device=dev, priority=-1) if cuda else None
    measure("alone", step_stream, None)
    if cuda:
        bg = Background(dev, args.bg_rows, args.bg_gb, torch.cuda.Stream(device=dev, priority=0))
        bg.start()
        time.sleep(1.0)
        res["background_alone_ms"] = bg.stop()
        print(f"background alone: {res['background_alone_ms']:.3f} ms a replay")
        measure("beside (step at -1, background 0)", step_stream, bg)
        for p in (int(v) for v in args.priorities.split(",") if v):
            measure(f"beside, step at priority {p}", torch.cuda.Stream(device=dev, priority=p), bg)
        del bg
        for n in (int(v) for v in args.green.split(",") if v):
            try:
                stream, ctx = green_stream(n, dev)
                green_bg = Background(dev, args.bg_rows, args.bg_gb, stream)
            except Exception as e:  # noqa: BLE001 - report what this torch or driver lacks, go on
                res["rows"].append(dict(setup=f"background on {n} SMs", error=repr(e)[:300]))
                print(f"background on {n} SMs: not available: {e!r}"[:300])
                continue
            measure(f"beside, background on {n} SMs", step_stream, green_bg)
            del green_bg, ctx
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print("\n| setup | " + " | ".join(steps) + " | background ms |")
    for r in res["rows"]:
        if "error" in r:
            print(f"| {r['setup']} | " + " | ".join("—" for _ in steps) + f" | {r['error'][:60]} |")
        else:
            bgm = "—" if r["background_ms"] is None else f"{r['background_ms']:.3f}"
            print(f"| {r['setup']} | " + " | ".join(f"{r['step_ms'][s]:.3f}" for s in steps) + f" | {bgm} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
