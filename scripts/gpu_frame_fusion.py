"""The code-predictor frame's one-launch fusions, timed and checked at the real shapes in one call.

    PYTHONUNBUFFERED=1 python scripts/gpu_frame_fusion.py --out $OUT/gpu_frame_fusion.json
    TRITON_INTERPRET=1 python scripts/gpu_frame_fusion.py --device cpu --preset tiny --frames 2   # logic

kernels/code_frame.py's switches for launches done in the last program of the launch before
(`_triton.arrive_last`): `FUSED_ATTENTION` (the q/k/v GEMV runs each head's attention) and, where the
tree has it, `FUSED_HEAD_SAMPLE` (the head's GEMV draws the code). Every combination, with and without
programmatic launches, greedy and with the code predictor's default sampling, at batches 1 and 4: the
frame graph's replay (CUDA events, medians), and its codes over `--frames` inputs, each replayed
`--repeats` times, against the plain two-launch frame's on the same inputs. A fused frame does the same
arithmetic on the same values, so the codes should be equal; a race in the arrival order (a program
reading a tile before it is stored) would show as a fraction below 1 or a replay that does not repeat.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_code_frame import build, frame_fns, graph_of, set_variant, time_ms  # noqa: E402  (this directory)
from omni_rt.kernels import code_frame  # noqa: E402

KNOBS = [k for k in ("FUSED_ATTENTION", "FUSED_HEAD_SAMPLE") if hasattr(code_frame, k)]


@torch.no_grad()
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-omni-30b-a3b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--frames", type=int, default=8, help="inputs per check")
    ap.add_argument("--repeats", type=int, default=10, help="replays of each input per check")
    ap.add_argument("--out", default="gpu_frame_fusion.json")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    t0 = time.perf_counter()
    cp = build(args.preset, dev, dtype)
    width = cp.cfg.hidden_size
    batches = [int(b) for b in args.batches.split(",")]
    frame_fn, _ = frame_fns(cp, max(batches), dev, fused=True)  # the head may draw in its launch
    gen = torch.Generator(device=dev).manual_seed(3)
    checks = {b: [torch.randn(2, b, width, generator=gen, device=dev).to(dtype) for _ in range(args.frames)]
              for b in batches}  # fmt: skip
    res = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else str(dev), "knobs": KNOBS,
           "rows": []}  # fmt: skip
    saved = {k: getattr(code_frame, k) for k in KNOBS}
    want: dict[tuple[int, str], list[torch.Tensor]] = {}  # the plain frame's codes per input
    for pdl, on in itertools.product((False, True), itertools.product((False, True), repeat=len(KNOBS))):
        set_variant(cp, "code_frame" if pdl else "code_frame no PDL")
        for k, v in zip(KNOBS, on, strict=True):
            setattr(code_frame, k, v)
        label = "+".join(
            [k.removeprefix("FUSED_").lower() for k, v in zip(KNOBS, on, strict=True) if v] or ["plain"]
        )
        label += " PDL" if pdl else ""
        for b, mode in itertools.product(batches, ("greedy", "sampled")):
            inputs = (torch.zeros(b, width, device=dev, dtype=dtype), torch.zeros(b, width, device=dev, dtype=dtype),
                      torch.arange(b, device=dev), torch.arange(b, device=dev) + 17)  # fmt: skip
            row = dict(variant=label, pdl=pdl, batch=b, mode=mode, **dict(zip(KNOBS, on, strict=True)))
            try:  # a variant that does not compile costs its row, not the run
                replay, out = graph_of(frame_fn(mode), inputs, dev)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"[:2000]
                res["rows"].append(row)
                print(f"{label:32} batch {b} {mode:8} failed: {row['error'][:300]}", flush=True)
                continue
            codes, repeats = [], True
            for x in checks[b]:
                inputs[0].copy_(x[0])
                inputs[1].copy_(x[1])
                replay()
                first = out.clone()
                for _ in range(args.repeats - 1):
                    replay()
                    repeats &= torch.equal(first, out)
                codes.append(first)
            ref = want.setdefault((b, mode), codes)  # the first variant is the plain one
            row["codes_equal_plain"] = float(
                torch.cat([(c == r).float().flatten() for c, r in zip(codes, ref, strict=True)]).mean()
            )
            row["replays_repeat"] = repeats
            row["ms"] = time_ms(replay, dev, args.reps)
            res["rows"].append(row)
            ms = "-" if row["ms"] is None else f"{row['ms']:.3f}"
            print(f"{label:32} batch {b} {mode:8} {ms} ms  equal {row['codes_equal_plain']:.4f} "
                  f"repeat {repeats}", flush=True)  # fmt: skip
    for k, v in saved.items():
        setattr(code_frame, k, v)
    res["total_s"] = time.perf_counter() - t0
    print(f"\n{'variant':32} {'batch':>5} {'mode':8} {'ms':>7} {'equal':>6} repeat")
    for r in res["rows"]:
        ms = "-" if r.get("ms") is None else f"{r['ms']:.3f}"
        eq = f"{r['codes_equal_plain']:.4f}" if "codes_equal_plain" in r else "error"
        print(
            f"{r['variant']:32} {r['batch']:>5} {r['mode']:8} {ms:>7} {eq:>6} {r.get('replays_repeat', '-')}"
        )
    Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
