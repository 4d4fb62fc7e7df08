"""Helpers the fused-kernel modules share that must not import Triton (the CPU path never needs it)."""

from __future__ import annotations

import functools

import torch
from omni_rt.kernels.moe_decode import triton_available

FUSED_ATTR = "_omni_fused"  # marks a function installed by a hook, so `fused.uninstall_all` removes only ours
FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def mark(fn, name: str):
    """Tag `fn` as the fused kernel `name`'s hook (what `fused.uninstall_all` looks for)."""
    setattr(fn, FUSED_ATTR, name)
    return fn


@functools.cache
def _triton_ok() -> bool:
    return triton_available()


def require_triton() -> None:
    """Raise unless Triton can run here (checked once: kernels call this on every launch)."""
    if not _triton_ok():
        raise RuntimeError("fused kernels need Triton and a CUDA device (or TRITON_INTERPRET=1 on the CPU)")


def precise() -> bool:
    """Whether kernels call libdevice's exp/sin/rsqrt (compiled code) or tl's (the interpreter)."""
    from omni_rt.kernels._triton import PRECISE

    return PRECISE


def rnd(dtype: torch.dtype) -> int:
    """The constexpr code with which a kernel rounds an intermediate to `dtype` (`_triton.round_to`)."""
    from omni_rt.kernels._triton import rnd_code

    return rnd_code(dtype)


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()
