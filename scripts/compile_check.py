"""Compile the code-predictor frame's Triton kernels for a GPU, on a machine without one.

    python scripts/compile_check.py                      # sm_90, the real shapes
    python scripts/compile_check.py --preset tiny --arch 80

Why: the kernels' tests run in Triton's interpreter, which executes Python, not the compiler: a kernel
can pass them and still not compile (a branch that yields two types, an op the interpreter takes and
the code generator does not), and a device session is too short to find that out. Triton compiles to a
cubin for any target without a device (`triton.compile` with a `GPUTarget`; ptxas ships in its wheel).

1. A child process with `TRITON_INTERPRET=1` runs the frame at the preset's shapes (bf16) with and
   without programmatic launches at batches 1, 4 and 8, and the fused sampler on the code predictor's
   rows (at batch 1 also as a programmatic launch, as the frame's programmatic graphs draw) and the
   Talker's, with every kernel launch recorded (argument types, constexprs, warps) and skipped: no
   arithmetic, so seconds, not hours.
2. This process (no interpreter) compiles each distinct launch for `sm_<arch>` and reports the failures.
   Shapes' alignment is not specialised as a launch would (the divisibility hints), so the code can
   differ from what a GPU runs; what cannot compile cannot compile either way. The installed Triton may
   not be the GPU machine's.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "int64": "i64", "int32": "i32",
         "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "i1"}  # fmt: skip


def _arg_type(value) -> str:
    import torch

    if isinstance(value, torch.Tensor):
        return "*" + TYPES[str(value.dtype).removeprefix("torch.")]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


def record(preset: str) -> list[dict]:
    """Step 1 (interpreter): the frame's and the sampler's launches, recorded, not run."""
    import torch
    import triton.runtime.interpreter as interp
    from omni_rt.kernels import _common

    # the constexprs a compiled launch gets (libdevice, fences, bf16 tensor-core dots), not the
    # interpreter's: bound before the kernel modules import it
    _common.precise = lambda: True
    sys.path.insert(0, str(ROOT / "scripts"))
    from gpu_code_frame import build  # noqa: PLC0415 - this directory
    from omni_rt.kernels import fused, sample

    from omni_rt.model import sampling as S
    from omni_rt.model.config import preset as config_of
    from omni_rt.model.talker import greedy

    launches: dict[str, dict] = {}

    def run(self, *args, grid, warmup, **kwargs):
        params = inspect.signature(self.fn).parameters
        bound = dict(zip(self.arg_names, args, strict=False)) | kwargs
        options = {k: bound.pop(k) for k in ("num_warps", "launch_pdl") if k in bound}
        signature, constexprs = {}, {}
        for name, p in params.items():
            value = bound[name]
            if "constexpr" in str(p.annotation) or value is None:
                signature[name], constexprs[name] = "constexpr", value
            else:
                signature[name] = _arg_type(value)
        rec = dict(module=self.fn.__module__, kernel=self.fn.__name__, signature=signature,
                   constexprs=constexprs, num_warps=options.get("num_warps", 4))  # fmt: skip
        launches.setdefault(json.dumps(rec, sort_keys=True, default=str), rec)

    interp.InterpretedFunction.run = run
    cpu = torch.device("cpu")
    cp = build(preset, cpu, torch.bfloat16)
    host = torch.nn.Module()
    host.cp = cp
    fused.install_all(host, ["code_frame"])
    frame = cp.frame_fn
    frame.pdl_runs = True  # record the programmatic variants too (the interpreter never launches them)
    width = cp.cfg.hidden_size
    with torch.no_grad():
        for pdl in (False, True):
            for b in (1, 4, 8):
                x = torch.zeros(b, width, dtype=torch.bfloat16)
                with frame.programmatic() if pdl else contextlib.nullcontext():
                    cp.predict(x, x, greedy)
        # the fused sampler, as the code predictor's frame and the Talker's step call it
        cfg = config_of(preset)
        stages = [("code_predictor", cfg.code_predictor.vocab_size, {"history": False}),
                  ("talker", cfg.talker.vocab_size, {"suppress": [cfg.ids.codec_eos]})]  # fmt: skip
        for stage, vocab, kw in stages:
            sampler = S.StageSampler(stage, 8, vocab, cpu, fused=True, **kw)
            for dtype in (torch.bfloat16, torch.float32):
                for b in (1, 8):
                    slots = torch.arange(b)
                    # and as a programmatic launch, as the frame's programmatic graphs draw
                    with sample.programmatic(stage == "code_predictor" and b == 1):
                        sample.fused_choose(torch.zeros(b, vocab, dtype=dtype), slots, slots, sampler)
    return list(launches.values())


def compile_all(launches: list[dict], arch: int) -> list[dict]:
    """Step 2 (compiled Triton): each launch to a cubin for sm_<arch>; -> one row per launch."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    rows = []
    for rec in launches:
        fn = getattr(importlib.import_module(rec["module"]), rec["kernel"])
        src = ASTSource(fn=fn, signature=rec["signature"], constexprs=rec["constexprs"])
        t0 = time.perf_counter()
        row = dict(kernel=rec["kernel"], num_warps=rec["num_warps"],
                   constexprs={k: v for k, v in rec["constexprs"].items() if v is not None})  # fmt: skip
        try:
            compiled = triton.compile(src, target=target, options={"num_warps": rec["num_warps"]})
            row["ok"], row["cubin_bytes"] = True, len(compiled.asm["cubin"])
        except Exception as e:
            row["ok"], row["error"] = False, f"{type(e).__name__}: {e}"[:3000]
        row["s"] = round(time.perf_counter() - t0, 2)
        rows.append(row)
        print(f"{'ok  ' if row['ok'] else 'FAIL'} {rec['kernel']:16} warps {rec['num_warps']} {row['s']:6.2f} s "
              f"{row.get('error', '')[:400]}", flush=True)  # fmt: skip
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-omni-30b-a3b")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--out", default=None, help="the rows as JSON")
    ap.add_argument("--record", action="store_true", help=argparse.SUPPRESS)  # step 1, in the child
    args = ap.parse_args(argv)
    if args.record:
        json.dump(record(args.preset), sys.stdout)
        return 0
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("step 2 compiles: run without TRITON_INTERPRET=1")
    env = dict(os.environ, TRITON_INTERPRET="1")
    child = subprocess.run(
        [sys.executable, __file__, "--record", "--preset", args.preset],
        env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    if child.returncode != 0:
        print(child.stderr[-4000:], file=sys.stderr)
        return 2
    launches = json.loads(child.stdout)
    rows = compile_all(launches, args.arch)
    failed = [r for r in rows if not r["ok"]]
    print(
        f"{len(rows)} launches compiled for sm_{args.arch}: {len(rows) - len(failed)} ok, {len(failed)} failed"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
