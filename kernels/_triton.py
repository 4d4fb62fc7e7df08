"""What the fused kernels share: the guarded Triton import, exact rounding, and PyTorch's math functions.

The fused kernels (`router`, `norm_rope`, `snake`) promise the plain path's numbers, and the plain path
rounds to the activation dtype after every PyTorch op (bf16 on the GPU). A kernel that keeps fp32 in
registers must therefore round at the same points, which `round_to` does:

- fp32 -> bf16 round-to-nearest-even by integer ops, not `x.to(tl.bfloat16)`: Triton's interpreter
  truncates in that cast (GPU code rounds to nearest even), so the CPU tests could not check bf16
  rounding points otherwise. The integer form gives the same bits on both.
- divisions by `tl.div_rn` (IEEE round-to-nearest, as PyTorch's CUDA kernels): Triton compiles `a / b` on
  fp32 to the approximate `div.full.f32`; means as PyTorch's CUDA `mean`, the sum times a 1/N factor.
- `exp`, `sin`, `rsqrt` through libdevice on the GPU: those are the functions PyTorch's CUDA kernels call
  (`expf`, `sinf`, `rsqrtf`; PyTorch is not built with fast math), whereas `tl.exp`/`tl.sin` lower to
  the approximate `ex2.approx`/`sin.approx` instructions. The interpreter cannot run libdevice calls,
  so it uses numpy's fp32 functions (within an ulp of PyTorch's CPU ones).

The kernels live at module level in `norm_rope`, `router` and `snake` (Triton's interpreter runs a
kernel with its module's globals, not its closure), behind a guarded import: without Triton those modules
still import and their plain-PyTorch references and fallbacks work. Set `TRITON_INTERPRET=1` before the
first import of Triton to run the kernels on the CPU.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

try:  # programmatic dependent launch (Hopper and later; Triton >= 3.3)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - depends on the Triton version
    gdc_launch_dependents = gdc_wait = None

# libdevice calls exist only in compiled code; the interpreter uses tl's numpy-backed functions
PRECISE = os.environ.get("TRITON_INTERPRET") != "1"

# rounding codes passed to kernels as constexpr: which dtype an intermediate is rounded to
RND_FP32, RND_BF16, RND_FP16 = 0, 1, 2


def rnd_code(dtype: torch.dtype) -> int:
    """The `round_to` code of a floating dtype (the dtype a plain PyTorch op would round to)."""
    codes = {torch.float32: RND_FP32, torch.bfloat16: RND_BF16, torch.float16: RND_FP16}
    if dtype not in codes:
        raise ValueError(f"fused kernels support float32, bfloat16 and float16, not {dtype}")
    return codes[dtype]


@triton.jit
def round_to(x, RND: tl.constexpr):
    """fp32 x rounded to the dtype coded by RND (nearest even), returned as fp32 (exactly representable)."""
    if RND == 1:
        b = x.to(tl.uint32, bitcast=True)
        # add half an ulp of bf16, plus one when the kept part is odd (ties to even), then drop 16 bits
        b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
        y = b.to(tl.float32, bitcast=True)
    elif RND == 2:
        y = x.to(tl.float16).to(tl.float32)  # numpy's astype in the interpreter rounds to nearest even
    else:
        y = x
    return y


@triton.jit
def exp_f32(x, PRECISE: tl.constexpr):
    if PRECISE:
        y = libdevice.exp(x)
    else:
        y = tl.exp(x)
    return y


@triton.jit
def sin_f32(x, PRECISE: tl.constexpr):
    if PRECISE:
        y = libdevice.sin(x)
    else:
        y = tl.sin(x)
    return y


@triton.jit
def rsqrt_f32(x, PRECISE: tl.constexpr):
    if PRECISE:
        y = libdevice.rsqrt(x)
    else:
        y = tl.rsqrt(x)
    return y


@triton.jit
def log_f32(x, PRECISE: tl.constexpr):
    if PRECISE:
        y = libdevice.log(x)
    else:
        y = tl.log(x)
    return y


# A few-rows kernel is launched as a programmatic dependent launch of the one before, where the card
# allows: it calls `gdc_launch_dependents` early and `gdc_wait` before it reads what earlier kernels wrote,
# so its launch and its weight loads overlap the previous kernel's tail (the code-predictor frame at batch
# 1: 2.05 -> 1.82 ms on an H200). A kernel launched so after one that never calls `gdc_launch_dependents`
# (a cuBLAS GEMM) starts as usual, when that one ends. Asked for by `EngineSettings.programmatic_launch`.


def pdl_runs(device: torch.device) -> bool:
    """Whether kernels on `device` can run as programmatic dependent launches (compiled code on sm_90+)."""
    return (
        gdc_wait is not None and PRECISE and device.type == "cuda"
        and torch.cuda.get_device_capability(device)[0] >= 9
    )  # fmt: skip
