"""The one-launch sampler (kernels/sample.py) against other versions of itself: microseconds per launch and
whether they draw the same ids, on the GPU, for the code predictor's and the Talker's default settings.

    git show 43d20df:kernels/sample.py > out/sample_43d20df.py      # here (the device copy has no git)
    python3 scripts/gpu_sampler_ab.py out/sample_43d20df.py --out $OUT/sampler_ab.json
    TRITON_INTERPRET=1 python3 scripts/gpu_sampler_ab.py out/sample_43d20df.py --device cpu   # draws only

Each version is loaded from its file beside the installed one ("this"); per stage and logit scale: one
row of 64 random bf16 logits at a time, 50 launches in a CUDA graph, the median of 5 replays of 10 graphs.
No histories (the Talker's would differ by the order the versions run in), so the draws must be equal.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omni_rt.kernels import sample as this  # noqa: E402

from omni_rt.config import Sampling  # noqa: E402
from omni_rt.model import sampling as S  # noqa: E402


def load(path: str):
    spec = importlib.util.spec_from_file_location(f"sample_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def us_per_launch(fn) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / 500)
    return statistics.median(times)


def fifty(mod, logits, slot, sampler):
    """50 draws of one version, each from its own row of `logits`, slot 0."""
    return lambda: [mod.fused_choose(logits[i : i + 1], slot, slot, sampler) for i in range(50)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("versions", nargs="*", help="other copies of kernels/sample.py")
    ap.add_argument("--out", default="sampler_ab.json")
    ap.add_argument(
        "--device", default="cuda", help="cpu: the draws only, in Triton's interpreter (no timing)"
    )
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    versions = {Path(p).stem: load(p) for p in args.versions} | {"this": this}
    stages = (
        (2048, "code_predictor", S.residual_code_sampling(Sampling().code_predictor)),
        (3072, "talker", Sampling().talker),
    )
    rows = []
    for vocab, stage, setting in stages:
        sampler = S.StageSampler(stage, 8, vocab, dev, history=False, fused=True)
        for slot in range(8):
            sampler.assign(slot, setting, seed=slot)
        first = torch.zeros(1, dtype=torch.long, device=dev)
        gen = torch.Generator(device=dev).manual_seed(0)
        for scale in (1.0, 3.0):
            logits = (torch.randn(64, vocab, device=dev, generator=gen) * scale).to(torch.bfloat16)
            draws = {}
            for name, mod in versions.items():
                draws[name] = torch.cat(
                    [mod.fused_choose(logits[i : i + 1], first, first + i, sampler) for i in range(64)]
                )
                us = us_per_launch(fifty(mod, logits, first, sampler)) if dev.type == "cuda" else None
                rows.append(dict(stage=stage, scale=scale, version=name, us=us))
            same = all(torch.equal(d, draws["this"]) for d in draws.values())
            for r in rows[-len(versions) :]:
                r["draws_equal"] = same
    print(f"{'stage':15} {'scale':>5} {'version':24} {'us':>7}  same draws")
    for r in rows:
        us = "-" if r["us"] is None else f"{r['us']:7.2f}"
        print(f"{r['stage']:15} {r['scale']:5.1f} {r['version']:24} {us:>7}  {r['draws_equal']}")
    Path(args.out).write_text(
        json.dumps(
            dict(device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", rows=rows), indent=1
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
