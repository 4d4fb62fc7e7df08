"""Install the fused decode kernels on a model from outside: the one call the engine makes.

    from omni_rt.kernels import fused
    fused.install_all(model)                        # every kernel; {"rmsnorm": n, "attention": n, ...}
    fused.install_all(model, enabled={"router"})    # a subset (the GPU script measures each one's share)
    fused.uninstall_all(model)                      # back to the plain path

Behind `EngineSettings.fused_kernels` (`omni_rt.engine.apply_kernels`; install after the weights are loaded and before any
CUDA graph is captured: graphs keep whatever launches they recorded). Each hook replaces a module
instance's method (`forward`, or `SparseMoe.route`) or fills the seam the model declares
(`Attention.qkv_fn`, `Attention.attn_fn`), and falls back to the plain code for inputs it does not cover, so prefill keeps the
plain path when `max_rows` is set. All but "decode_attention" round where the plain path rounds (bf16
results equal, up to an ulp where a sum runs in another order); "decode_attention" agrees with SDPA to
about a bf16 ulp, as SDPA's own backends agree with each other.

| kernel      | patches                                  | launches per call, plain -> fused                   |
|-------------|------------------------------------------|------------------------------------------------------|
| "rmsnorm"   | `layers.RMSNorm.forward`                 | ~8 -> 1                                              |
| "attention" | `layers.Attention.qkv_fn`                | q/k norm, RoPE, 2 cache writes: ~30 -> 1             |
| "router"    | `layers.SparseMoe.route`                 | ~7 -> 1 (2 with fuse_gate=False)                     |
| "snake"     | `code2wav.SnakeBeta.forward`             | ~9 -> 1                                              |
| "decode_attention" | sets `layers.Attention.attn_fn`   | 2 cache gathers + masked SDPA: 3-5 -> 1              |
| "code_frame" | sets `talker.CodePredictor.frame_fn`   | a code-predictor frame: ~1,270 -> ~420 (code_frame.py) |
| "code2wav"  | Code2Wav's attention, MLP, layers, blocks, convs | a streaming step: see code2wav_step.py's table |
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from omni_rt.kernels._common import FUSED_ATTR, require_triton
from omni_rt.kernels.code2wav_step import install_code2wav
from omni_rt.kernels.code_frame import install_code_frame
from omni_rt.kernels.decode_attention import install_decode_attention
from omni_rt.kernels.norm_rope import install_attention, install_rmsnorm
from omni_rt.kernels.router import install_router
from omni_rt.kernels.snake import install_snake

KERNELS = ("rmsnorm", "attention", "router", "snake", "decode_attention", "code_frame", "code2wav")
_PATCHED = ("forward", "route", "step")  # instance attributes the hooks add (removed to undo)
_SEAMS = ("qkv_fn", "attn_fn", "frame_fn")  # override points the model declares (reset to None to undo)


def install_all(
    model: torch.nn.Module,
    enabled: bool | Collection[str] = True,
    *,
    max_rows: int | None = 16,
    prefill: bool = True,
    fuse_gate: bool = False,
    programmatic_launch: bool = False,
) -> dict[str, int]:
    """Install the `enabled` kernels (True: all of KERNELS, False: none) on `model`; modules patched per kernel.

    max_rows: decode attention runs for decode steps (T = 1, any B) and calls of at most this many token
    rows (B*T), and leaves larger ones of several tokens a row (prefill) to SDPA; None: every call. prefill: the row-wise kernels (RMSNorm, q/k norm + RoPE +
    cache write, router) run for calls of any size, prefill included (they work row by row, so a long
    prompt is just more programs); False: they too stop at `max_rows`. fuse_gate: the router
    computes the gate logits itself (one launch) instead of taking them from the module's gate (two;
    ids then bit-equal to `SparseMoe.route`). Off by default: measured on an H200 (docs/performance.md),
    the gate GEMM plus the kernel took 8.5 µs per Thinker layer, the kernel with the gate inside 25.8.
    programmatic_launch: the code frame's few-rows kernels as programmatic dependent launches in every
    frame, where the card runs them (`EngineSettings.programmatic_launch` says why by default only frames
    while the Thinker is idle take them). Installing twice replaces the earlier hooks.
    """
    names = list(KERNELS) if enabled is True else [] if enabled is False else list(enabled)
    unknown = sorted(set(names) - set(KERNELS))
    if unknown:
        raise ValueError(f"unknown fused kernels {unknown}; choose from {KERNELS}")
    if names:
        require_triton()
    done: dict[str, int] = {}
    for name in KERNELS:
        if name not in names:
            continue
        row_max = None if prefill else max_rows
        if name == "rmsnorm":
            done[name] = install_rmsnorm(model, row_max)
        elif name == "attention":
            done[name] = install_attention(model, row_max)
        elif name == "router":
            done[name] = install_router(model, fuse_gate=fuse_gate, max_rows=row_max)
        elif name == "decode_attention":
            done[name] = install_decode_attention(model, max_rows)
        elif name == "code_frame":
            done[name] = install_code_frame(model, programmatic_launch=programmatic_launch)
        elif name == "code2wav":
            done[name] = install_code2wav(model)
        else:
            done[name] = install_snake(model)
    return done


def uninstall_all(model: torch.nn.Module) -> int:
    """Remove every hook installed by this package from `model`; returns how many were removed."""
    removed = 0
    for m in model.modules():
        for attr in _PATCHED:
            if hasattr(m.__dict__.get(attr), FUSED_ATTR):
                delattr(m, attr)
                removed += 1
        for attr in _SEAMS:
            if hasattr(getattr(m, attr, None), FUSED_ATTR):
                setattr(m, attr, None)
                removed += 1
    return removed
