"""MoE prefill on the GPU at the Thinker's and Talker's real shapes: the Triton kernel vs grouped GEMM.

    PYTHONUNBUFFERED=1 python scripts/gpu_moe_prefill.py --out $OUT/gpu_moe_prefill.json
    TRITON_INTERPRET=1 python scripts/gpu_moe_prefill.py --device cpu --out /tmp/x.json   # logic check

For each shape and prefill size N, each path (`moe_grouped_mm`, the model's `experts_grouped_mm`, and
`moe_prefill_triton` at a few tile configs) is checked against an fp32 reference (per expert, fp32
weights) and timed inside one CUDA graph: R calls cycling over 4 layers' random weights with different
routings, so weights stream from HBM rather than the 60 MB L2, replayed between CUDA events. Capture
itself proves the path never syncs with the host. The floor is the unique experts touched x 3*H*I*2
bytes over 4.2 TB/s (`--bw`; the script measures the copy bandwidth too). Also: whether the kernel's
output is bit-identical on repeat, and the share of its elements bit-equal to `moe_grouped_mm`'s.
"--device cpu" runs tiny shapes in Triton's interpreter, eagerly (no graphs; times are meaningless).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from gpu_moe_common import LAYERS, SHAPES, R, make_inputs, make_layers, measure_bandwidth, rel_err, time_graph

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

CPU_SHAPES = {  # interpreter: tiny, but with empty experts, several blocks per expert and ragged tiles
    "thinker": dict(E=16, H=64, I=48, k=8),
    "talker": dict(E=16, H=32, I=32, k=6),
}
CONFIGS = [
    dict(block_m=16, block_n=64, block_k=128, block_n_down=64, block_k_down=128, num_warps=4, num_stages=4),
    dict(block_m=16, block_n=32, block_k=256, block_n_down=32, block_k_down=256, num_warps=4, num_stages=3),
    dict(block_m=16, block_n=128, block_k=64, block_n_down=128, block_k_down=64, num_warps=4, num_stages=4),
    dict(block_m=32, block_n=64, block_k=128, block_n_down=64, block_k_down=128, num_warps=4, num_stages=4),
    dict(block_m=64, block_n=64, block_k=64, block_n_down=64, block_k_down=64, num_warps=4, num_stages=3),
]
CPU_CONFIGS = [dict(block_m=16, block_n=16, block_k=16, block_n_down=16, block_k_down=16, num_warps=4)]


def reference_fp32(x, ids, w, gu, dn):
    """The exact value: per touched expert, fp32 weights and activations (syncs: fine for a reference)."""
    inter = dn.shape[-1]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    xf = x.float()
    for e in ids.unique().tolist():
        tok, slot = torch.where(ids == e)
        h = xf[tok] @ gu[e].float().T  # [n_e, 2I]
        a = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
        out.index_add_(0, tok, (a @ dn[e].float().T) * w[tok, slot, None].float())
    return out


def time_eager(fn, layers, inputs):
    t0 = time.perf_counter()
    for r in range(2):
        gu, dn = layers[r % len(layers)]
        fn(*inputs[r % len(inputs)], gu, dn)
    return float("nan"), (time.perf_counter() - t0) / 2 * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu_moe_prefill.json")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--ns", default=None, help="prefill sizes (default 16,41,57,97,128,256; cpu 16,21)")
    ap.add_argument("--shapes", default="thinker,talker")
    ap.add_argument("--configs", default=None, help="indices into CONFIGS (default: all)")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--bw", type=float, default=4.2e12, help="bytes/s for the floor (measured value printed)")
    args = ap.parse_args(argv)
    cpu = args.device == "cpu"
    if cpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first `import triton`
    try:
        import omni_rt.kernels  # noqa: F401
    except ImportError:  # not installed: map kernels/ to omni_rt.kernels as pyproject's package-dir does
        import importlib.util

        root = Path(__file__).resolve().parents[1] / "kernels"
        spec = importlib.util.spec_from_file_location(
            "omni_rt.kernels", root / "__init__.py", submodule_search_locations=[str(root)]
        )
        sys.modules["omni_rt.kernels"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["omni_rt.kernels"])
    from omni_rt.kernels import moe_decode as md
    from omni_rt.kernels import moe_prefill as mp

    try:
        from omni_rt.model import layers as layers_mod
    except Exception as exc:  # noqa: BLE001 - report and carry on with kernels/ paths
        print(f"omni_rt.model.layers not importable ({exc!r}); timing kernels/ paths only")
        layers_mod = None

    t_start = time.perf_counter()
    dev = torch.device(args.device)
    dtype = torch.bfloat16
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference in fp32
    shapes = CPU_SHAPES if cpu else SHAPES
    configs = CPU_CONFIGS if cpu else CONFIGS
    if args.configs is not None:
        configs = [configs[int(i)] for i in args.configs.split(",")]
    ns = [int(v) for v in (args.ns or ("16,21" if cpu else "16,41,57,97,128,256")).split(",")]
    n_layers = 1 if cpu else LAYERS
    result = {
        "device": "cpu (Triton interpreter)" if cpu else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "configs": configs,
        "rows": [],
    }
    if not cpu:
        result["measured_copy_bw_TBps"] = measure_bandwidth(dev) / 1e12
        print(f"copy bandwidth {result['measured_copy_bw_TBps']:.2f} TB/s (floor uses {args.bw / 1e12:.2f})")

    for name in args.shapes.split(","):
        shape = shapes[name]
        H, inter = shape["H"], shape["I"]
        layers = make_layers(shape, dtype, dev, n_layers)
        for n in ns:
            inputs = [make_inputs(shape, n, dtype, dev, seed=100 * n + r) for r in range(R if not cpu else 2)]
            uniq = sum(len(torch.unique(inp[1])) for inp in inputs) / len(inputs)
            floor_us = uniq * 3 * H * inter * 2 / args.bw * 1e6
            x, ids, w = inputs[0]
            gu, dn = layers[0]
            ref = reference_fp32(x, ids, w, gu, dn)
            base = md.moe_grouped_mm(x, ids, w, gu, dn)
            paths = {"grouped_mm": md.moe_grouped_mm}
            if layers_mod is not None:
                paths["model.grouped_mm"] = layers_mod.experts_grouped_mm
            for ci, cfg in enumerate(configs):
                paths[f"triton#{ci}"] = lambda *a, _c=cfg: mp.moe_prefill_triton(*a, **_c)
            paths["align only"] = lambda x_, ids_, *a, _e=shape["E"]: mp.moe_prefill_align(ids_, _e, 16)[1]
            for pname, fn in paths.items():
                try:
                    got = fn(x, ids, w, gu, dn)
                    row = dict(shape=name, n=n, path=pname, floor_us=floor_us, unique_experts=uniq)
                    if pname != "align only":
                        again = fn(x, ids, w, gu, dn)
                        row.update(
                            max_rel_err=rel_err(got, ref),
                            max_abs_err=float((got.float() - ref).abs().max()),
                            bitwise_repeat=bool(torch.equal(got, again)),
                            eq_grouped_mm=float((got == base).float().mean()),
                        )
                    if cpu:
                        us, eager = time_eager(fn, layers, inputs)
                    else:
                        us, eager = time_graph(fn, layers, inputs, args.replays)
                    row.update(us_graphed=us, us_eager=eager, ratio=us / floor_us)
                    if pname.startswith("triton#"):
                        row["config"] = configs[int(pname[7:])]
                except Exception as exc:  # noqa: BLE001 - one failing path must not hide the others
                    print(f"{name} N={n} {pname}: FAILED {exc!r}")
                    row = dict(shape=name, n=n, path=pname, error=repr(exc))
                result["rows"].append(row)
                print(
                    f"  {name} N={n} {pname}: "
                    + ", ".join(
                        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                    )
                )
        del layers
        if not cpu:
            torch.cuda.empty_cache()

    result["wall_s"] = time.perf_counter() - t_start
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print()
    print(
        f"{'shape':8} {'N':>4} {'path':16} {'graph us':>9} {'floor us':>8} {'x floor':>7} "
        f"{'rel err':>8} {'repeat':>6} {'=gmm':>5}"
    )
    for r in result["rows"]:
        if "error" in r:
            print(f"{r['shape']:8} {r['n']:>4} {r['path']:16} FAILED")
            continue
        us = r["us_graphed"] if not cpu else r["us_eager"]
        err = f"{r['max_rel_err']:8.1e}" if "max_rel_err" in r else f"{'':8}"
        rep = str(r.get("bitwise_repeat", ""))
        eq = f"{r['eq_grouped_mm']:5.2f}" if "eq_grouped_mm" in r else ""
        print(
            f"{r['shape']:8} {r['n']:>4} {r['path']:16} {us:9.1f} {r['floor_us']:8.1f} "
            f"{us / r['floor_us']:7.2f} {err} {rep:>6} {eq:>5}"
        )
    print(f"wall {result['wall_s']:.1f} s" + ("  (cpu: eager interpreter times, meaningless)" if cpu else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
