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

from omni_rt.kernels import code_frame, fused  # noqa: E402
from omni_rt.kernels import packed as packed_kernels  # noqa: E402
from omni_rt.kernels import sample as sample_kernel  # noqa: E402

from omni_rt.config import Sampling  # noqa: E402
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
    if variant.startswith("code_frame"):
        fused.install_all(host, ["code_frame"], programmatic_launch=variant == "code_frame")


@torch.no_grad()
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-omni-30b-a3b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--out", default="gpu_code_frame.json")
    ap.add_argument("--quick", action="store_true", help="two batch-1 shapes, no batch-8 sweep")
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
    sampler = S.StageSampler(
        "code_predictor", max(batches), vocab, dev, history=False, fused=dev.type == "cuda"
    )
    for slot in range(max(batches)):
        sampler.assign(slot, S.residual_code_sampling(Sampling().code_predictor), seed=1000 + slot)

    def frame_fn(mode):
        def frame(hidden, code0_embed, slots, keys):
            sample = greedy if mode == "greedy" else S.frame_sampler(sampler, slots, keys)
            return cp.predict(hidden, code0_embed, sample)

        return frame

    outputs = {}
    for variant in ("plain", "fused layers", "code_frame no PDL", "code_frame"):
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
                print(
                    f"{variant:14} batch {b:3} {mode:8} {ms if ms is None else round(ms, 3)} ms", flush=True
                )
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
        res["checks"][f"code_frame {mode}: codes equal to fused layers (fraction)"] = float(
            (got == ref).float().mean()
        )
        res["checks"][f"code_frame {mode}: first code equal (fraction)"] = float(
            (got[:, 0] == ref[:, 0]).float().mean()
        )
        res["checks"][f"code_frame {mode}: replay repeats"] = repeat
        res["checks"][f"code_frame {mode}: PDL == no PDL"] = bool(
            torch.equal(got, outputs[("code_frame no PDL", mode)][0])
        )
    # block shapes: the batch-1 GEMV, then batch 8 (the few-rows path over more rows, or tl.dot tiles)
    if dev.type == "cuda":
        set_variant(cp, "code_frame")  # with PDL where it runs
        saved = (dict(code_frame.GEMV_BLOCKS), dict(code_frame.DOT_BLOCKS), code_frame.SMALL_M)
        kinds_served = dict(code_frame.GEMV_KIND_BLOCKS)
        code_frame.GEMV_KIND_BLOCKS.clear()  # the one-shape sweeps: that shape for all five linears

        def sweep(b, label, settings):
            inputs = (torch.randn(b, width, device=dev).to(dtype), torch.randn(b, width, device=dev).to(dtype),
                      torch.arange(b, device=dev), torch.arange(b, device=dev))  # fmt: skip
            for gemv, dot, small_m in settings:
                code_frame.GEMV_BLOCKS.update(gemv)
                code_frame.DOT_BLOCKS.update(dot)
                code_frame.SMALL_M = small_m
                replay, _ = graph_of(frame_fn("greedy"), inputs, dev)
                ms = time_ms(replay, dev, args.reps)
                res["sweep"].append(dict(batch=b, gemv=dict(code_frame.GEMV_BLOCKS), dot=dict(code_frame.DOT_BLOCKS),
                                         small_m=small_m, ms=ms))  # fmt: skip
                print(
                    f"sweep batch {b} {label} gemv={gemv} dot={dot} small_m={small_m}: {ms:.3f} ms",
                    flush=True,
                )
                code_frame.GEMV_BLOCKS.update(saved[0])
                code_frame.DOT_BLOCKS.update(saved[1])
                code_frame.SMALL_M = saved[2]

        g1 = [dict(BN=4, BK=1024, num_warps=4), dict(BN=4, BK=1024, num_warps=2), dict(BN=2, BK=1024, num_warps=2),
              dict(BN=4, BK=2048, num_warps=4), dict(BN=4, BK=4096, num_warps=8), dict(BN=1, BK=1024, num_warps=2)]  # fmt: skip
        sweep(1, "gemv", [(g, {}, 4) for g in g1[:1] + g1[3:4]] if args.quick else [(g, {}, 4) for g in g1])
        d8 = [dict(BM=16, BN=16, BK=256, num_warps=4), dict(BM=16, BN=32, BK=256, num_warps=4),
              dict(BM=16, BN=16, BK=512, num_warps=4), dict(BM=16, BN=32, BK=512, num_warps=8),
              dict(BM=16, BN=64, BK=256, num_warps=8)]  # fmt: skip
        few = [dict(BM=4, BN=4, BK=1024, num_warps=4), dict(BM=8, BN=4, BK=512, num_warps=4),
               dict(BM=2, BN=4, BK=1024, num_warps=4)]  # fmt: skip
        if not args.quick:
            sweep(8, "dot", [({}, d, 4) for d in d8])
            sweep(8, "few-rows", [(g, {}, 16) for g in few])
        code_frame.GEMV_KIND_BLOCKS.update(kinds_served)
        # per linear (GEMV_KIND_BLOCKS): each of the five in other shapes alone, then each one's best together
        inputs = (torch.randn(1, width, device=dev).to(dtype), torch.randn(1, width, device=dev).to(dtype),
                  torch.arange(1, device=dev), torch.arange(1, device=dev))  # fmt: skip
        served = dict(code_frame.GEMV_KIND_BLOCKS)
        replay, _ = graph_of(frame_fn("greedy"), inputs, dev)
        res["kind_sweep"] = dict(served=served, served_ms=time_ms(replay, dev, args.reps), rows=[])
        code_frame.GEMV_KIND_BLOCKS.clear()  # each linear's shapes against none overridden
        replay, _ = graph_of(frame_fn("greedy"), inputs, dev)
        base = time_ms(replay, dev, args.reps)
        res["kind_sweep"]["base_ms"] = base
        print(f"per-linear: as served {served} {res['kind_sweep']['served_ms']:.3f} ms, none {base:.3f} ms")
        tried = [dict(BN=8, num_warps=8), dict(BN=8, num_warps=4), dict(BN=2, num_warps=2), dict(BN=4, num_warps=2),
                 dict(BN=16, num_warps=8)]  # fmt: skip
        # down_proj's K (3072) is over BK (2048): two tiles, and its weights are not fetched before the
        # programmatic wait (only one-tile GEMVs are); one tile of 4096 does both
        extra = {"down": [dict(BK=4096, num_warps=4), dict(BK=4096, num_warps=8)]}
        best: dict[str, tuple[float, dict]] = {}
        for kind in ("qkv", "o_proj", "gate_up", "down", "head"):
            for blocks in (tried[:3] if args.quick else tried) + extra.get(kind, []):
                code_frame.GEMV_KIND_BLOCKS.clear()
                code_frame.GEMV_KIND_BLOCKS[kind] = blocks
                replay, _ = graph_of(frame_fn("greedy"), inputs, dev)
                ms = time_ms(replay, dev, args.reps)
                res["kind_sweep"]["rows"].append(dict(kind=kind, blocks=blocks, ms=ms))
                print(f"per-linear sweep {kind} {blocks}: {ms:.3f} ms (as served {base:.3f})", flush=True)
                if ms < best.get(kind, (base,))[0]:
                    best[kind] = (ms, blocks)
        code_frame.GEMV_KIND_BLOCKS.clear()
        code_frame.GEMV_KIND_BLOCKS.update({kind: blocks for kind, (_, blocks) in best.items()})
        for mode in ("greedy", "sampled"):
            replay, _ = graph_of(frame_fn(mode), inputs, dev)
            ms = time_ms(replay, dev, args.reps)
            res["kind_sweep"][f"best_together_{mode}_ms"] = ms
            print(
                f"per-linear best together {dict(code_frame.GEMV_KIND_BLOCKS)}: {mode} {ms:.3f} ms",
                flush=True,
            )
        res["kind_sweep"]["best"] = dict(code_frame.GEMV_KIND_BLOCKS)
        code_frame.GEMV_KIND_BLOCKS.clear()
        code_frame.GEMV_KIND_BLOCKS.update(served)
        # the sampler's variants (kernels/sample.py): 16-bit keys or 32, the hash in uint32, its warps; on the
        # per-linear sweep's batch-1 inputs
        res["sampler_variants"] = []
        knobs = ("SHORT_KEYS", "HASH32", "SAMPLE_WARPS")
        saved = {k: getattr(sample_kernel, k) for k in knobs}
        variants = [{}, {"SHORT_KEYS": False}, {"HASH32": True}, {"SAMPLE_WARPS": 1}, {"SAMPLE_WARPS": 2},
                    {"SAMPLE_WARPS": 8}, {"SAMPLE_WARPS": 16}, {"HASH32": True, "SAMPLE_WARPS": 8}]  # fmt: skip
        for variant in variants:
            for k in knobs:
                setattr(sample_kernel, k, variant.get(k, saved[k]))
            try:  # a variant that does not compile (never run on a GPU before) costs its row, not the sweep
                replay, out = graph_of(frame_fn("sampled"), inputs, dev)
            except Exception as e:
                res["sampler_variants"].append(dict(variant=variant, error=f"{type(e).__name__}: {e}"[:2000]))
                print(f"sampler {variant}: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            ms = time_ms(replay, dev, args.reps)
            replay()
            res["sampler_variants"].append(dict(variant=variant, ms=ms, codes=out.tolist()))
            print(f"sampler {variant or 'as served'}: sampled frame batch 1 {ms:.3f} ms", flush=True)
        for k in knobs:
            setattr(sample_kernel, k, saved[k])
        res["checks"]["sampler variants draw the same codes"] = all(
            r["codes"] == res["sampler_variants"][0]["codes"] for r in res["sampler_variants"] if "codes" in r
        )
        # one kernel of each kind alone, 50 launches in a graph: microseconds per launch (batch 1)
        slot0 = torch.zeros(1, dtype=torch.long, device=dev)
        cf = cp.frame_fn
        x = torch.randn(1, width, device=dev).to(dtype)
        ln1, qkv_w, q_w, k_w, o_w, ln2, gate_up, down = cf.layers[0]
        qkv = cf._linear("qkv", x, qkv_w, 1, norm=ln1)
        attn = cf._attention(qkv, q_w, k_w, cp.cache, 0, 1, 1, 8)
        act = cf._linear("gate_up", x, gate_up, 1, norm=ln2, swiglu=True)
        kinds = {
            "norm + qkv GEMV (4096x1024)": lambda: cf._linear("qkv", x, qkv_w, 1, norm=ln1),
            "attention (position 8)": lambda: cf._attention(qkv, q_w, k_w, cp.cache, 0, 1, 1, 8),
            "o_proj + residual (1024x2048)": lambda: cf._linear("o_proj", attn, o_w, 1, residual=x),
            "norm + gate_up + SwiGLU (6144x1024)": lambda: cf._linear(
                "gate_up", x, gate_up, 1, norm=ln2, swiglu=True
            ),
            "down + residual (1024x3072)": lambda: cf._linear("down", act, down, 1, residual=x),
            "norm + head (2048x1024)": lambda: cf._linear("head", x, cf.heads[0], 1, norm=cf.final_norm),
            "greedy argmax": lambda: greedy(qkv[:, :2048]),
            "sampler, code-predictor defaults": lambda: sampler(qkv[:, :vocab], slot0, slot0),
        }
        res["kernels_us"] = {}
        for name, fn in kinds.items():
            replay, _ = graph_of(lambda fn=fn: [fn() for _ in range(50)], (), dev)
            ms = time_ms(replay, dev, args.reps)
            res["kernels_us"][name] = ms * 1e3 / 50
            print(f"kernel {name}: {ms * 1e3 / 50:.2f} us per launch", flush=True)
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
