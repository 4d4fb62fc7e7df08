"""The code-predictor frame with the head choosing its own code (kernels/head_sample.py) against the head
then the argmax or sampler launch, at the real shapes, each captured in a CUDA graph and timed on the GPU.

    PYTHONUNBUFFERED=1 python scripts/gpu_head_sample.py --out $OUT/gpu_head_sample.json
    TRITON_INTERPRET=1 python scripts/gpu_head_sample.py --device cpu --preset tiny --batches 1 --reps 1

Per FUSED_ATTENTION (off, on), FUSED_HEAD_SAMPLE (off, on), batch and mode (greedy, sampled): the replay's
median over `--reps` runs of 20 replays (CUDA events, programmatic launches where the card runs them).
Checks: the codes with the one-launch head equal the two launches' (the same inputs, the same keys), and
a replay repeats its codes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_code_frame import build, graph_of, set_variant, time_ms  # noqa: E402
from omni_rt.kernels import code_frame, head_sample  # noqa: E402

from omni_rt.config import Sampling  # noqa: E402
from omni_rt.model import sampling as S  # noqa: E402
from omni_rt.model.talker import greedy  # noqa: E402


@torch.no_grad()
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-omni-30b-a3b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--batches", default="1,2,4")
    ap.add_argument("--out", default="gpu_head_sample.json")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    t0 = time.perf_counter()
    cp = build(args.preset, dev, dtype)
    set_variant(cp, "code_frame")
    width, vocab = cp.cfg.hidden_size, cp.cfg.vocab_size
    batches = [int(b) for b in args.batches.split(",")]
    sampler = S.StageSampler("code_predictor", max(batches), vocab, dev, history=False, fused=True)
    for slot in range(max(batches)):
        sampler.assign(slot, S.residual_code_sampling(Sampling().code_predictor), seed=1000 + slot)
    launches = []
    launch = head_sample.head_choose
    head_sample.head_choose = lambda *a: launches.append(a[3]) or launch(*a)

    def frame_fn(mode):
        def frame(hidden, code0_embed, slots, keys):
            sample = greedy if mode == "greedy" else S.frame_sampler(sampler, slots, keys)
            return cp.predict(hidden, code0_embed, sample)

        return frame

    res = {
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else str(dev), "torch": torch.__version__,
        "rows": [], "checks": {},
    }  # fmt: skip
    codes = {}
    for attention in (False, True):
        for head in (False, True):
            code_frame.FUSED_ATTENTION, code_frame.FUSED_HEAD_SAMPLE = attention, head
            for b in batches:
                gen = torch.Generator(device=dev).manual_seed(b)
                inputs = (
                    torch.randn(b, width, generator=gen, device=dev).to(dtype),
                    torch.randn(b, width, generator=gen, device=dev).to(dtype),
                    torch.arange(b, device=dev),
                    torch.arange(b, device=dev) + 17,
                )
                for mode in ("greedy", "sampled"):
                    launches.clear()
                    try:  # a variant that does not compile costs its row, not the run
                        replay, out = graph_of(frame_fn(mode), inputs, dev)
                    except Exception as e:
                        res["rows"].append(dict(attention=attention, head=head, batch=b, mode=mode,
                                                error=f"{type(e).__name__}: {e}"[:3000]))  # fmt: skip
                        print(
                            f"attention {attention} head {head} batch {b} {mode}: failed: {e!s:.2000}",
                            flush=True,
                        )
                        continue
                    fused_heads = len(launches)
                    ms = time_ms(replay, dev, args.reps)
                    replay()
                    first = out.clone()
                    replay()
                    codes[(attention, head, b, mode)] = first
                    res["rows"].append(dict(attention=attention, head=head, batch=b, mode=mode, ms=ms,
                                            fused_heads=fused_heads, repeats=torch.equal(first, out)))  # fmt: skip
                    print(f"attention {attention!s:5} head {head!s:5} batch {b} {mode:8} "
                          f"{ms if ms is None else round(ms, 4)} ms (fused heads {fused_heads})", flush=True)  # fmt: skip
    for (attention, head, b, mode), got in codes.items():
        want = codes.get((attention, False, b, mode))
        if head and want is not None:
            res["checks"][f"attention {attention} batch {b} {mode}: head on == off"] = torch.equal(got, want)
    for key, got in codes.items():
        if key[3] == "sampled" and (key[:3] + ("greedy",)) in codes:
            res["checks"][f"{key[:3]} sampled != greedy"] = not torch.equal(got, codes[key[:3] + ("greedy",)])
    res["total_s"] = time.perf_counter() - t0
    for k, v in res["checks"].items():
        print(f"check: {k}: {v}")
    Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
