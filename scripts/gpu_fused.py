"""The fused decode kernels (kernels/fused.py) at real shapes: correctness, and time against the plain path.

    PYTHONUNBUFFERED=1 python scripts/gpu_fused.py --out $OUT/gpu_fused.json
    python scripts/gpu_fused.py --preset tiny --device cpu --out /tmp/gpu_fused.json   # logic check, interpreter

Builds the preset with random weights (bf16 on the GPU, fp32 on the CPU), then:

1. Per op, per stage (Thinker, Talker, code predictor; Code2Wav for SnakeBeta), at `--rows` decode rows:
   the plain code (the model's own `RMSNorm.forward`, `Attention.forward`'s q/k norm + RoPE + cache
   write, `SparseMoe.route`, `SnakeBeta.forward`) against the kernel, over every layer of the stage (so
   each layer's own weights are read), captured in one CUDA graph; time per call = graph time / calls.
   Correctness: bf16 ulps between the two (max, and the share of bit-equal values); for the router the
   share of rows whose ids are equal, and the largest weight difference.
2. Whole steps, plain vs `install_all`, both with the Triton MoE decode kernel: a Thinker decode step,
   a Talker step, a code-predictor frame (15 steps), a 1-frame Code2Wav step; eager and graphed time,
   kernels per eager call (torch.profiler), the largest logit/sample difference, greedy agreement, and
   whether the graphed step equals its eager run bit for bit.
Prints a short table last and writes everything to --out (JSON).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-omni-30b-a3b")
    ap.add_argument(
        "--device", default="cuda", help="cpu (with --preset tiny) runs the kernels in the interpreter"
    )
    ap.add_argument("--rows", default="1,4", help="decode rows (batch sizes) for the per-op part")
    ap.add_argument("--cache-len", type=int, default=512)
    ap.add_argument("--skip-steps", action="store_true", help="per-op part only")
    ap.add_argument(
        "--no-shares", action="store_true", help="whole steps: skip the one-kernel-at-a-time rows"
    )
    ap.add_argument("--out", default="gpu_fused.json")
    return ap.parse_args(argv)


ARGS = _args(sys.argv[1:] if __name__ == "__main__" else [])
if ARGS.device == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first import of Triton

import torch  # noqa: E402

sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def _kernels_package():
    """`omni_rt.kernels` (the source tree's kernels/ when omni_rt is not installed, as on the GPU machine)."""
    try:
        import omni_rt.kernels as pkg

        return pkg
    except ImportError:
        import omni_rt

        spec = importlib.util.spec_from_file_location(
            "omni_rt.kernels",
            ROOT / "kernels" / "__init__.py",
            submodule_search_locations=[str(ROOT / "kernels")],
        )
        pkg = importlib.util.module_from_spec(spec)
        sys.modules["omni_rt.kernels"] = pkg
        spec.loader.exec_module(pkg)
        omni_rt.kernels = pkg
        return pkg


_kernels_package()
from gpu_stages import time_fn  # noqa: E402
from omni_rt.kernels import decode_attention, fused, norm_rope, router, snake  # noqa: E402
from omni_rt.kernels import moe_decode as md  # noqa: E402

from omni_rt.model import code2wav, layers  # noqa: E402
from omni_rt.model.config import preset  # noqa: E402
from omni_rt.model.omni import OmniModel  # noqa: E402
from omni_rt.pipeline.graphs import capture  # noqa: E402


# ----------------------------------------------------------------------------------------------------
# Measuring
# ----------------------------------------------------------------------------------------------------
def graphed_ms(fn, inputs) -> float:
    """Time of `fn(*inputs)` captured in a CUDA graph (eager on the CPU), median ms per call."""
    return time_fn(capture(fn, inputs), *inputs)


def kernels_per_call(fn, inputs, calls: int = 3) -> float | None:
    """CUDA kernels launched per eager call (None on the CPU)."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    fn(*inputs)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(calls):
            fn(*inputs)
        torch.cuda.synchronize()
    return sum(1 for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA) / calls


def ulps(a: torch.Tensor, b: torch.Tensor) -> dict:
    """Max distance in units of the dtype's last place, and the share of bit-equal values."""
    if a.dtype == torch.bfloat16:
        d = (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()
        return dict(max_ulps=int(d.max()), equal=float((d == 0).float().mean()))
    d = (a.float() - b.float()).abs()
    return dict(max_abs=float(d.max()), equal=float((a == b).float().mean()))


def _row(res, **row) -> dict:
    res["rows"].append(row)
    print(json.dumps(row), flush=True)
    return row


def _guard(res, name, fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - one failing measurement must not hide the others
        print(f"{name}: FAILED {exc!r}", flush=True)
        res["rows"].append(dict(what=name, error=repr(exc)))


# ----------------------------------------------------------------------------------------------------
# 1. Per op
# ----------------------------------------------------------------------------------------------------
def op_rmsnorm(res, stage, layer_list, n, dev, dtype):
    norms = [ly.input_layernorm for ly in layer_list]
    x = torch.randn(n, 1, norms[0].weight.shape[0], device=dev, dtype=dtype)

    def plain(x):
        return [norm_rope.rmsnorm_reference(m, x) for m in norms]

    def fast(x):
        return [norm_rope.rmsnorm(x, m.weight, m.eps) for m in norms]

    check = ulps(torch.stack(fast(x)), torch.stack(plain(x)))
    t0, t1 = graphed_ms(plain, (x,)), graphed_ms(fast, (x,))
    k = len(norms)
    _row(res, what=f"{stage} rmsnorm", rows=n, plain_us=t0 * 1e3 / k, fused_us=t1 * 1e3 / k, **check)


def op_attention(res, stage, layer_list, rotary, n, dev, dtype, cache_len):
    attns = [ly.self_attn for ly in layer_list]
    a0 = attns[0]
    cache = layers.KVCache(len(attns), n, a0.n_kv_heads, cache_len, a0.head_dim, device=dev, dtype=dtype)
    other = layers.KVCache(len(attns), n, a0.n_kv_heads, cache_len, a0.head_dim, device=dev, dtype=dtype)
    slots = torch.arange(n, device=dev).flip(0)  # rows write to slots in another order
    positions = (torch.arange(n, device=dev) * 7 + 3)[:, None] % cache_len  # [N, 1], all different
    cos, sin = rotary(positions, dtype)
    q = torch.randn(n, 1, a0.n_heads * a0.head_dim, device=dev, dtype=dtype)
    k = torch.randn(n, 1, a0.n_kv_heads * a0.head_dim, device=dev, dtype=dtype)
    v = torch.randn_like(k)

    def plain(q, k, v):
        return [layers.qk_norm_rope_cache(a, q, k, v, cos, sin, cache, slots, positions) for a in attns]

    def fast(q, k, v):
        return [
            norm_rope.qk_norm_rope_cache(
                q, k, v, a.q_norm.weight, a.k_norm.weight, a.q_norm.eps, cos, sin,
                other.k[a.layer_idx], other.v[a.layer_idx], slots, positions,
            )
            for a in attns
        ]  # fmt: skip

    check_q = ulps(torch.stack(fast(q, k, v)), torch.stack(plain(q, k, v)).contiguous())
    check_k = ulps(other.k, cache.k)
    v_equal = bool(torch.equal(other.v, cache.v))
    t0, t1 = graphed_ms(plain, (q, k, v)), graphed_ms(fast, (q, k, v))
    m = len(attns)
    _row(
        res, what=f"{stage} q/k norm + rope + cache write", rows=n, plain_us=t0 * 1e3 / m, fused_us=t1 * 1e3 / m,
        q=check_q, k_cache=check_k, v_cache_equal=v_equal,
    )  # fmt: skip


def op_decode_attention(res, stage, layer_list, n, dev, dtype, cache_len):
    attns = [ly.self_attn for ly in layer_list]
    a0 = attns[0]
    g = torch.Generator(device="cpu").manual_seed(1)
    shape = (len(attns), n, a0.n_kv_heads, cache_len, a0.head_dim)
    k_all = torch.randn(shape, generator=g).to(dev, dtype)
    v_all = torch.randn(shape, generator=g).to(dev, dtype)
    q = torch.randn(n, a0.n_heads, 1, a0.head_dim, generator=g).to(dev, dtype)
    slots = torch.arange(n, device=dev).flip(0)
    positions = (cache_len - 1 - torch.arange(n, device=dev) * 37)[:, None].clamp(min=0)  # [N, 1], long rows
    mask = layers.attention_mask(positions, cache_len, a0.n_heads // a0.n_kv_heads)

    def plain(q):
        return [
            layers.attend(q, k_all[i], v_all[i], slots, positions, mask, cache_len) for i in range(len(attns))
        ]

    def fast(q):
        return [
            decode_attention.decode_attention(q, k_all[i], v_all[i], slots, positions, mask, cache_len)
            for i in range(len(attns))
        ]

    check = ulps(torch.stack(fast(q)), torch.stack(plain(q)))
    t0, t1 = graphed_ms(plain, (q,)), graphed_ms(fast, (q,))
    m = len(attns)
    configs = {}  # block_n, num_warps -> us per call (the default is 64, 8)
    for bn, w in ((32, 4), (32, 8), (64, 4)):

        def cfg(q, bn=bn, w=w):
            return [
                decode_attention.decode_attention(
                    q, k_all[i], v_all[i], slots, positions, mask, cache_len, block_n=bn, num_warps=w
                )
                for i in range(m)
            ]

        configs[f"block_n={bn},warps={w}"] = graphed_ms(cfg, (q,)) * 1e3 / m
    _row(
        res, what=f"{stage} decode attention, kv_len {cache_len}", rows=n, plain_us=t0 * 1e3 / m,
        fused_us=t1 * 1e3 / m, **check, configs_us=configs,
    )  # fmt: skip


def op_router(res, stage, layer_list, n, dev, dtype):
    moes = [ly.mlp for ly in layer_list]
    x = torch.randn(n, moes[0].gate.in_features, device=dev, dtype=dtype)

    def plain(x):
        return [router.route_reference(m, x) for m in moes]

    def fast_gate(x):
        return [router.fused_route(x, m.gate.weight, m.top_k, m.norm_topk_prob) for m in moes]

    def fast_logits(x):
        return [
            router.fused_route(x, m.gate.weight, m.top_k, m.norm_topk_prob, logits=m.gate(x)) for m in moes
        ]

    # ids agreement over many rows: each layer's gate on 64 random rows, in chunks of n
    xs = torch.randn(64, x.shape[1], device=dev, dtype=dtype)
    agree = {"fuse_gate": [], "logits": []}
    max_w = {"fuse_gate": 0.0, "logits": 0.0}
    for m in moes:
        rw, ri = router.route_reference(m, xs)
        for mode, logits in (("fuse_gate", None), ("logits", m.gate(xs))):
            w, i = router.fused_route(xs, m.gate.weight, m.top_k, m.norm_topk_prob, logits=logits)
            # ids as sets: tied probabilities may sit in either order (see kernels/router.py)
            agree[mode].append((i.sort(-1).values == ri.sort(-1).values).all(-1).float().mean().item())
            same_order = (i == ri).all(-1)
            if same_order.any():
                max_w[mode] = max(max_w[mode], (w - rw)[same_order].abs().max().item())
    t0 = graphed_ms(plain, (x,))
    t1 = graphed_ms(fast_gate, (x,))
    t2 = graphed_ms(fast_logits, (x,))
    k = len(moes)
    configs = {}  # block_h, num_warps -> us per call (the default is 32, 8)
    for bh, w in ((16, 8), (64, 8), (32, 4)):

        def cfg(x, bh=bh, w=w):
            return [
                router.fused_route(x, m.gate.weight, m.top_k, m.norm_topk_prob, block_h=bh, num_warps=w)
                for m in moes
            ]

        configs[f"block_h={bh},warps={w}"] = graphed_ms(cfg, (x,)) * 1e3 / k
    _row(
        res, what=f"{stage} router", rows=n, plain_us=t0 * 1e3 / k, fused_us=t1 * 1e3 / k,
        fused_logits_us=t2 * 1e3 / k,
        ids_equal_fuse_gate=sum(agree["fuse_gate"]) / k, ids_equal_logits=sum(agree["logits"]) / k,
        max_weight_diff_fuse_gate=max_w["fuse_gate"], max_weight_diff_logits=max_w["logits"], configs_us=configs,
    )  # fmt: skip


def op_snake(res, c2w, dev, dtype):
    """Every SnakeBeta of a 1-frame Code2Wav step, at the inputs that step gives it."""
    acts, inputs = [], []

    def recorder(mod):  # an instance forward, not a pre-hook: the last SnakeBeta is called as .step()
        def forward(x):
            acts.append(mod)
            inputs.append(x.clone())
            return snake.snake_reference(mod, x)

        return forward

    snakes = [m for m in c2w.modules() if isinstance(m, code2wav.SnakeBeta)]
    for m in snakes:
        m.forward = recorder(m)
    try:
        codes = torch.randint(0, c2w.cfg.codebook_size, (1, c2w.cfg.num_quantizers, 1), device=dev)
        c2w.step(codes, c2w.new_state(1))
    finally:
        for m in snakes:
            del m.forward
    xs = tuple(inputs)

    def plain(*xs):
        return [snake.snake_reference(a, x) for a, x in zip(acts, xs, strict=True)]

    def fast(*xs):
        return [snake.snake(x, a.alpha, a.beta) for a, x in zip(acts, xs, strict=True)]

    got, ref = fast(*xs), plain(*xs)
    check = ulps(torch.cat([g.flatten() for g in got]), torch.cat([r.flatten() for r in ref]))
    t0, t1 = graphed_ms(plain, xs), graphed_ms(fast, xs)
    _row(
        res, what=f"code2wav snake x{len(acts)} (1-frame chunk)", rows=1, plain_us=t0 * 1e3 / len(acts),
        fused_us=t1 * 1e3 / len(acts), per_chunk_plain_us=t0 * 1e3, per_chunk_fused_us=t1 * 1e3, **check,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------------
# 2. Whole steps
# ----------------------------------------------------------------------------------------------------
def steps(model, cfg, dev, dtype, cache_len):
    """name -> (fn, inputs, prep): one step each, batch 1, state reset by prep() before compared runs."""
    th, tk, c2w = model.thinker, model.talker, model.code2wav
    slots = torch.zeros(1, dtype=torch.long, device=dev)
    T = 57
    g = torch.Generator(device="cpu").manual_seed(0)  # the same inputs for the plain and the fused run

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dev, dtype)

    prompt = torch.randint(0, cfg.thinker.vocab_size, (1, T), generator=g).to(dev)
    tcache = th.allocate_cache(1, cache_len)
    th(prompt, torch.arange(T, device=dev)[None], tcache, slots, last_only=True)

    def thinker_step(ids, p):
        return th(ids, p, tcache, slots)[0][:, -1]  # logits [1, V]

    kcache = tk.allocate_cache(1, cache_len)
    tk(randn(1, 40, cfg.talker.hidden_size, scale=0.02), torch.arange(40, device=dev)[None], kcache, slots)

    def talker_step(x, p):
        return tk(x, p, kcache, slots)[0][:, -1]  # codec logits [1, V]

    tk.code_predictor.setup_cache(1, dev, dtype)

    def cp_frame(h, c0):
        return tk.predict_frame(h, c0)  # codes [1, 16]

    state = c2w.new_state(1)

    def c2w_step(c):
        return c2w.step(c, state)

    def reset():
        state.reset()

    codes = torch.randint(0, cfg.code2wav.codebook_size, (1, cfg.code2wav.num_quantizers, 1), generator=g)
    return {
        "thinker decode step": (thinker_step, (torch.tensor([[17]], device=dev), torch.tensor([[T]], device=dev)), None),
        "talker step": (talker_step, (randn(1, 1, cfg.talker.hidden_size, scale=0.02),
                                      torch.tensor([[40]], device=dev)), None),
        "code predictor frame (15 steps)": (cp_frame, (randn(1, cfg.talker.hidden_size),
                                                       torch.tensor([5], device=dev)), None),
        "code2wav step, 1 frame": (c2w_step, (codes.to(dev),), reset),
    }  # fmt: skip


def run_step(fn, inputs, prep):
    if prep:
        prep()
    out = fn(*inputs).clone()
    eager = time_fn(fn, *inputs, blocks=3, reps=10)
    g = capture(fn, inputs)
    if prep:
        prep()
    got = g(*inputs).clone()
    return (
        out,
        eager,
        time_fn(g, *inputs, blocks=3, reps=10),
        bool(torch.equal(out, got)),
        kernels_per_call(fn, inputs),
    )


def compare_steps(res, model, cfg, dev, dtype, cache_len, shares: bool):
    """Every step plain and with all kernels; with `shares`, also the step each kernel touches most with
    that kernel alone (its share of the saving)."""
    variants = [("plain", False, None), ("fused", True, None)]
    if shares:
        variants += [
            (f"only {k}", {k}, "code2wav step, 1 frame" if k == "snake" else "thinker decode step")
            for k in fused.KERNELS
        ]
    plain_out = {}
    for variant, enabled, only in variants:
        fused.uninstall_all(model)
        installed = fused.install_all(model, enabled)
        if variant == "fused":
            res["installed"] = installed
            print(f"install_all: {installed}", flush=True)
        for name, (fn, inputs, prep) in steps(model, cfg, dev, dtype, cache_len).items():
            if only is not None and name != only:
                continue

            def one(name=name, fn=fn, inputs=inputs, prep=prep, variant=variant):
                out, eager, graphed, graph_eq, kernels = run_step(fn, inputs, prep)
                row = dict(what=f"{name} [{variant}]", eager_ms=eager, graphed_ms=graphed,
                           graph_equals_eager=graph_eq, kernels_per_call=kernels)  # fmt: skip
                if variant == "plain":
                    plain_out[name] = out
                elif name in plain_out:
                    ref = plain_out[name]
                    row["vs_plain"] = ulps(out, ref) if out.is_floating_point() else None
                    if out.is_floating_point() and out.dim() == 2 and "code2wav" not in name:
                        row["greedy_equal"] = bool(torch.equal(out.argmax(-1), ref.argmax(-1)))
                    if not out.is_floating_point():
                        row["codes_equal"] = float((out == ref).float().mean())
                _row(res, **row)

            _guard(res, f"{name} [{variant}]", one)
    fused.uninstall_all(model)


# ----------------------------------------------------------------------------------------------------
@torch.no_grad()
def main() -> int:
    args = ARGS
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cfg = preset(args.preset)
    res: dict = {
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (Triton interpreter)",
        "torch": torch.__version__,
        "preset": args.preset,
        "dtype": str(dtype),
        "rows": [],
    }
    t = time.perf_counter()
    model = OmniModel.build(cfg, device=dev, dtype=dtype, weights="random", seed=0)
    print(f"build {time.perf_counter() - t:.1f} s", flush=True)
    if md.triton_available():
        res["moe_blocks"] = md.install(model, "triton")  # both variants: the fused path adds to it

    stages = {
        "thinker": (model.thinker.model.layers, model.thinker.rotary),
        "talker": (model.talker.model.layers, model.talker.rotary),
        "code predictor": (model.talker.code_predictor.model.layers, model.talker.code_predictor.rotary),
    }
    for n in [int(r) for r in args.rows.split(",")]:
        for stage, (layer_list, rotary) in stages.items():
            _guard(res, f"{stage} rmsnorm", partial(op_rmsnorm, res, stage, layer_list, n, dev, dtype))
            _guard(
                res,
                f"{stage} attention",
                partial(op_attention, res, stage, layer_list, rotary, n, dev, dtype, args.cache_len),
            )
            _guard(
                res,
                f"{stage} decode attention",
                partial(op_decode_attention, res, stage, layer_list, n, dev, dtype, args.cache_len),
            )
            if isinstance(layer_list[0].mlp, layers.SparseMoe):
                _guard(res, f"{stage} router", partial(op_router, res, stage, layer_list, n, dev, dtype))
    _guard(res, "code2wav snake", partial(op_snake, res, model.code2wav, dev, dtype))
    if not args.skip_steps:
        compare_steps(res, model, cfg, dev, dtype, args.cache_len, shares=not args.no_shares)

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print()
    print(f"{'what':44} {'rows':>4} {'plain us':>9} {'fused us':>9} {'x':>5}  check")
    for r in res["rows"]:
        if "error" in r:
            print(f"{r['what']:44} FAILED {r['error'][:60]}")
        elif "plain_us" in r:
            chk = {k: v for k, v in r.items() if k not in ("what", "rows", "plain_us", "fused_us")}
            print(
                f"{r['what']:44} {r['rows']:4} {r['plain_us']:9.2f} {r['fused_us']:9.2f} "
                f"{r['plain_us'] / r['fused_us']:5.2f}  {json.dumps(chk)[:110]}"
            )
    print(f"\n{'step':44} {'eager ms':>9} {'graph ms':>9} {'kernels':>8}  check")
    for r in res["rows"]:
        if "graphed_ms" in r:
            chk = {
                k: r[k] for k in ("graph_equals_eager", "vs_plain", "greedy_equal", "codes_equal") if k in r
            }
            kern = "-" if r["kernels_per_call"] is None else f"{r['kernels_per_call']:.0f}"
            print(f"{r['what']:44} {r['eager_ms']:9.3f} {r['graphed_ms']:9.3f} {kern:>8}  {json.dumps(chk)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
