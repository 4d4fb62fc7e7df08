"""MoE decode on the GPU at the real Thinker and Talker shapes: correctness and time per layer.

    PYTHONUNBUFFERED=1 python scripts/gpu_kernels.py --out $OUT/gpu_kernels.json

For each shape and decode batch N, every expert path is checked against the fp32 reference
(`moe_decode_reference`) and timed inside one CUDA graph (R calls cycling over 4 layers' weights with
different routings, so weights are streamed from HBM and not served from the 60 MB L2), replayed many
times between CUDA events. The bytes floor is the unique selected experts' weights over the card's
measured copy bandwidth (4.2 TB/s by default; `--bw` overrides, and the script measures it too).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
from gpu_moe_common import SHAPES, R, make_inputs, make_layers, measure_bandwidth, rel_err, time_graph

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
try:
    from omni_rt.kernels import moe_decode as md
except ImportError:  # not installed editable: load the kernels folder directly
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
    import moe_decode as md  # type: ignore[no-redef]

TRITON_CONFIGS = [
    dict(block_i=16, block_h=256, block_h_down=16, block_i_down=256, num_warps=4),
    dict(block_i=8, block_h=512, block_h_down=8, block_i_down=256, num_warps=4),
    dict(block_i=32, block_h=128, block_h_down=8, block_i_down=512, num_warps=4),
    dict(block_i=16, block_h=512, block_h_down=16, block_i_down=512, num_warps=8),
    dict(block_i=8, block_h=256, block_h_down=4, block_i_down=256, num_warps=2),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu_kernels.json")
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--bw", type=float, default=4.2e12, help="bytes/s for the floor (measured value printed)")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    dtype = torch.bfloat16
    torch.manual_seed(0)
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "rows": [],
    }
    result["measured_copy_bw_TBps"] = measure_bandwidth(dev) / 1e12
    print(f"copy bandwidth {result['measured_copy_bw_TBps']:.2f} TB/s (floor uses {args.bw / 1e12:.2f})")
    batches = [int(b) for b in args.batches.split(",")]
    layers_mod = None
    try:
        from omni_rt.model import layers as layers_mod  # A1's paths, when present in the tree
    except Exception as exc:  # noqa: BLE001 - report and carry on with ours
        print(f"omni_rt.model.layers not importable ({exc!r}); timing kernels/ paths only")
    for name, shape in SHAPES.items():
        layers = make_layers(shape, dtype, dev)
        H, inter = shape["H"], shape["I"]
        for n in batches:
            inputs = [make_inputs(shape, n, dtype, dev, seed=100 * n + r) for r in range(R)]
            uniq = sum(len(torch.unique(inp[1])) for inp in inputs) / len(inputs)
            floor_us = uniq * 3 * H * inter * 2 / args.bw * 1e6
            x, ids, w = inputs[0]
            gu, dn = layers[0]
            ref = md.moe_decode_reference(x, ids, w, gu, dn)
            paths = {"loop": md.moe_loop, "grouped_mm": md.moe_grouped_mm}
            if layers_mod is not None:
                paths["A1.gather"] = layers_mod.experts_gather
                paths["A1.grouped_mm"] = layers_mod.experts_grouped_mm
            for ci, cfg in enumerate(TRITON_CONFIGS):
                paths[f"triton#{ci}"] = lambda *a, _c=cfg: md.moe_decode_triton(*a, **_c)
            for pname, fn in paths.items():
                try:
                    err = rel_err(fn(x, ids, w, gu, dn), ref)
                    us, eager = time_graph(fn, layers, inputs)
                except Exception as exc:  # noqa: BLE001 - one failing path must not hide the others
                    print(f"{name} N={n} {pname}: FAILED {exc!r}")
                    result["rows"].append(dict(shape=name, n=n, path=pname, error=repr(exc)))
                    continue
                row = dict(
                    shape=name,
                    n=n,
                    path=pname,
                    us_graphed=us,
                    us_eager=eager,
                    floor_us=floor_us,
                    ratio=us / floor_us,
                    max_rel_err=err,
                    unique_experts=uniq,
                )
                if pname.startswith("triton#"):
                    row["config"] = TRITON_CONFIGS[int(pname[7:])]
                result["rows"].append(row)
            torch.cuda.synchronize()
        # Determinism: the same inputs give the same bits.
        x, ids, w = make_inputs(shape, 4, dtype, dev, seed=7)
        a = md.moe_decode_triton(x, ids, w, *layers[0])
        b = md.moe_decode_triton(x, ids, w, *layers[0])
        result[f"{name}_triton_bitwise_repeat"] = bool(torch.equal(a, b))
        del layers
        torch.cuda.empty_cache()

    # The hook end to end: A1's SparseMoe at the Thinker's config, grouped_mm vs the installed kernel.
    if layers_mod is not None:
        try:
            from omni_rt.model.config import preset

            cfg = preset("qwen3-omni-30b-a3b").thinker
            moe = layers_mod.SparseMoe(cfg).to(dev, dtype)
            with torch.no_grad():
                for p in moe.parameters():
                    p.normal_(0, 1 / math.sqrt(p.shape[-1]))
                x = torch.randn(1, 1, cfg.hidden_size, device=dev, dtype=dtype)
                base = moe(x)
                n_inst = md.install(moe, "triton")
                fused = moe(x)
            result["sparse_moe_install"] = dict(blocks=n_inst, max_rel_err=rel_err(fused, base))
        except Exception as exc:  # noqa: BLE001
            result["sparse_moe_install"] = dict(error=repr(exc))

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print()
    print(
        f"{'shape':8} {'N':>2} {'path':14} {'graphed us':>10} {'eager us':>9} {'floor us':>8} {'x floor':>7} {'rel err':>8}"
    )
    for r in result["rows"]:
        if "error" in r:
            print(f"{r['shape']:8} {r['n']:>2} {r['path']:14} FAILED")
            continue
        print(
            f"{r['shape']:8} {r['n']:>2} {r['path']:14} {r['us_graphed']:10.1f} {r['us_eager']:9.1f} "
            f"{r['floor_us']:8.1f} {r['ratio']:7.2f} {r['max_rel_err']:8.1e}"
        )
    for key in [k for k in result if k.endswith("bitwise_repeat") or k == "sparse_moe_install"]:
        print(key, result[key])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
