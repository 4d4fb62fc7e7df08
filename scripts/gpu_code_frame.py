"""The code-predictor frame at the real shapes: the plain frame, the per-layer fused kernels, and
kernels/code_frame.py, greedy and sampled, each captured in a CUDA graph and timed on the GPU.

    PYTHONUNBUFFERED=1 python scripts/gpu_code_frame.py --out $OUT/gpu_code_frame.json
    TRITON_INTERPRET=1 python scripts/gpu_code_frame.py --device cpu --preset tiny --reps 1   # logic only

Builds only the predictor (`qwen3-omni-30b-a3b`'s code_predictor config, 5 layers, random bf16 weights)
so it starts in seconds. Per variant and batch: the replay's median over `--reps` runs of 20 replays
(CUDA events). Checks: code_frame's greedy codes against the per-layer fused path's on random inputs
(bf16 sums run in another order, so a code can differ where two logits are within an ulp; the fraction
is reported), and its sampled codes the same on every replay. Then a block-shape sweep of the GEMV at
batch 1. The floor: the frame's weight bytes over the card's bandwidth (4.8 TB/s for an H200).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omni_rt.config import Sampling  # noqa: E402
from omni_rt.kernels import code_frame, fused  # noqa: E402
from omni_rt.kernels import packed as packed_kernels  # noqa: E402
from omni_rt.model import sampling as S  # noqa: E402
from omni_rt.model.config import preset  # noqa: E402
from omni_rt.model.talker import CodePredictor, greedy  # noqa: E402

BANDWIDTH = 4.8e12  # H200 HBM3e, bytes/s


def build(name: str, device, dtype) -> CodePredictor:
    cfg = preset(name)
    torch.manual_seed(0)
    cp = CodePredictor(cfg.code_predictor, cfg.num_code_groups)
    with torch.no_grad():
        for p in cp.parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    return cp.to(device=device, dtype=dtype)


def graph_of(fn, args, device):
    if device.type != "cuda":  # a stand-in for a graph: replays write the same output tensor
        out = fn(*args)
        return (lambda: out.copy_(fn(*args))), out
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # compiles the kernels, fills the caches
            fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn(*args)
    return g.replay, out


def time_ms(replay, device, reps: int) -> float | None:
    if device.type != "cuda":
        return None
    runs = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        replay()
        s.record()
        for _ in range(20):
            replay()
        e.record()
        torch.cuda.synchronize()
        runs.append(s.elapsed_time(e) / 20)
    return statistics.median(runs)


def set_variant(cp: CodePredictor, variant: str) -> None:
    host = torch.nn.Module()
    host.cp = cp
    fused.uninstall_all(host)
    packed_kernels.uninstall_packed(host)
    if variant == "plain":
        return
    packed_kernels.install_packed(host)
    fused.install_all(host, [k for k in fused.KERNELS if k != "code_frame"])
    if variant == "code_frame":
        fused.install_all(host, ["code_frame"])


@torch.no_grad()
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-omni-30b-a3b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--out", default="gpu_code_frame.json")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    t0 = time.perf_counter()
    cp = build(args.preset, dev, dtype)
    def nbytes(module) -> int:
        return sum(p.numel() * p.element_size() for p in module.parameters())

    # every step reads all layers' weights and one head: 15 x layers + the 15 heads once each
    floor_ms = (15 * nbytes(cp.model.layers) + nbytes(cp.lm_head)) / BANDWIDTH * 1e3
    width, vocab = cp.cfg.hidden_size, cp.cfg.vocab_size
    batches = [int(b) for b in args.batches.split(",")]
    res = {
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else str(dev), "torch": torch.__version__,
        "floor_ms_batch1": floor_ms, "rows": [], "checks": {}, "sweep": [],
    }  # fmt: skip
    gen = torch.Generator(device=dev).manual_seed(1)
    sampler = S.StageSampler("code_predictor", max(batches), vocab, dev, history=False, fused=dev.type == "cuda")
    for slot in range(max(batches)):
        sampler.assign(slot, S.residual_code_sampling(Sampling().code_predictor), seed=1000 + slot)

    def frame_fn(mode):
        def frame(hidden, code0_embed, slots, keys):
            sample = greedy if mode == "greedy" else S.frame_sampler(sampler, slots, keys)
            return cp.predict(hidden, code0_embed, sample)

        return frame

    outputs = {}
    for variant in ("plain", "fused layers", "code_frame"):
        set_variant(cp, variant)
        for b in batches:
            inputs = (
                torch.randn(b, width, generator=gen, device=dev).to(dtype),
                torch.randn(b, width, generator=gen, device=dev).to(dtype),
                torch.arange(b, device=dev),
                torch.arange(b, device=dev) + 17,
            )
            for mode in ("greedy", "sampled"):
                replay, out = graph_of(frame_fn(mode), inputs, dev)
                ms = time_ms(replay, dev, args.reps)
                res["rows"].append(dict(variant=variant, batch=b, mode=mode, ms=ms))
                print(f"{variant:14} batch {b:3} {mode:8} {ms if ms is None else round(ms, 3)} ms", flush=True)
                if b == max(batches):
                    torch.manual_seed(5)  # the same inputs for every variant
                    h = torch.randn(b, width, device=dev).to(dtype)
                    c = torch.randn(b, width, device=dev).to(dtype)
                    inputs[0].copy_(h)
                    inputs[1].copy_(c)
                    replay()
                    first = out.clone()
                    replay()
                    outputs[(variant, mode)] = (first, torch.equal(first, out))
    for mode in ("greedy", "sampled"):
        ref, _ = outputs[("fused layers", mode)]
        got, repeat = outputs[("code_frame", mode)]
        res["checks"][f"code_frame {mode}: codes equal to fused layers (fraction)"] = float((got == ref).float().mean())
        res["checks"][f"code_frame {mode}: first code equal (fraction)"] = float((got[:, 0] == ref[:, 0]).float().mean())
        res["checks"][f"code_frame {mode}: replay repeats"] = repeat
    # block shapes of the batch-1 GEMV
    if dev.type == "cuda":
        set_variant(cp, "code_frame")
        inputs = (torch.randn(1, width, device=dev).to(dtype), torch.randn(1, width, device=dev).to(dtype),
                  torch.arange(1, device=dev), torch.arange(1, device=dev))  # fmt: skip
        saved = dict(code_frame.GEMV_BLOCKS)
        for bn, bk, warps in ((8, 1024, 8), (4, 1024, 4), (8, 2048, 8), (4, 2048, 8), (16, 1024, 8), (8, 4096, 8),
                              (8, 512, 8), (2, 1024, 4)):  # fmt: skip
            code_frame.GEMV_BLOCKS.update(BN=bn, BK=bk, num_warps=warps)
            replay, _ = graph_of(frame_fn("greedy"), inputs, dev)
            ms = time_ms(replay, dev, args.reps)
            res["sweep"].append(dict(BN=bn, BK=bk, num_warps=warps, ms=ms))
            print(f"sweep BN={bn} BK={bk} warps={warps}: {ms:.3f} ms", flush=True)
        code_frame.GEMV_BLOCKS.update(saved)
    res["total_s"] = time.perf_counter() - t0
    print(f"\nfloor at batch 1: {floor_ms:.3f} ms")
    print(f"{'variant':14} {'batch':>5} {'mode':8} {'ms':>8}")
    for r in res["rows"]:
        ms = "-" if r["ms"] is None else f"{r['ms']:8.3f}"
        print(f"{r['variant']:14} {r['batch']:>5} {r['mode']:8} {ms:>8}")
    for k, v in res["checks"].items():
        print(f"check: {k}: {v}")
    Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
