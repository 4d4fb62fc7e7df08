"""Fused SnakeBeta for Code2Wav: `x + 1 / (e^beta + 1e-9) * sin^2(x e^alpha)` per channel, in one launch.

Why: `code2wav.SnakeBeta.forward` is ~9 launches (two exps over the parameters, an add, a reciprocal, a
product, sin, square, product, sum) and Code2Wav calls it 29 times per chunk (docs/performance.md).

Numbers: the plain forward rounds every op to the activation dtype; the kernel rounds at the same points
(`_triton.round_to`): e^alpha, e^beta, e^beta + 1e-9, its reciprocal (PyTorch's `1.0 / t` is
`t.reciprocal() * 1.0`), x e^alpha, its sine, the square, the product, the sum. exp and sin are libdevice's
on the GPU, the functions PyTorch's CUDA kernels call, so bf16 results match bit for bit; in the
interpreter numpy's fp32 exp/sin stand in (within an ulp of PyTorch's CPU ones). The per-channel factors
are computed in the kernel from the parameters (two exps per program, nothing cached), so the hook stays
right after weights are reloaded and inside CUDA graphs.
"""

from __future__ import annotations

import torch
from omni_rt.kernels._common import FLOATS, mark, next_pow2, precise, require_triton, rnd
from omni_rt.kernels.moe_decode import triton_cdiv

from omni_rt.model import code2wav


def snake_reference(act: code2wav.SnakeBeta, x: torch.Tensor) -> torch.Tensor:
    """`code2wav.SnakeBeta.forward` itself (the class's, even when the instance's forward is patched)."""
    return code2wav.SnakeBeta.forward(act, x)


try:  # the kernels need Triton; the references and the hooks' plain fallbacks do not
    import triton
    import triton.language as tl
    from omni_rt.kernels._triton import exp_f32, round_to, sin_f32
except ImportError:  # pragma: no cover - depends on the machine
    triton = None

if triton is not None:

    @triton.jit
    def _snake(
        x_ptr,  # [B, C, T], unit stride along T
        a_ptr,  # [C] alpha (log scale)
        b_ptr,  # [C] beta (log scale)
        o_ptr,  # [B, C, T] contiguous
        C,
        T,
        stride_xb,
        stride_xc,
        BLOCK_T: tl.constexpr,
        RND: tl.constexpr,
        PRECISE: tl.constexpr,
    ):
        row = tl.program_id(0)  # b * C + c
        tb = tl.program_id(1)
        bi = row // C
        c = row % C
        t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
        m = t < T
        alpha = round_to(exp_f32(tl.load(a_ptr + c).to(tl.float32), PRECISE), RND)
        beta = round_to(exp_f32(tl.load(b_ptr + c).to(tl.float32), PRECISE), RND)
        inv_beta = round_to(tl.div_rn(1.0, round_to(beta + 1e-9, RND)), RND)  # IEEE, as PyTorch's reciprocal
        x = tl.load(x_ptr + bi.to(tl.int64) * stride_xb + c.to(tl.int64) * stride_xc + t, mask=m, other=0.0)
        x = x.to(tl.float32)
        s = round_to(sin_f32(round_to(x * alpha, RND), PRECISE), RND)
        y = round_to(x + round_to(inv_beta * round_to(s * s, RND), RND), RND)
        tl.store(o_ptr + row.to(tl.int64) * T + t, y.to(o_ptr.dtype.element_ty), mask=m)


def snake(
    x: torch.Tensor,  # [B, C, T]
    alpha: torch.Tensor,  # [C]
    beta: torch.Tensor,  # [C]
    *,
    block_t: int = 1024,
    num_warps: int = 4,
) -> torch.Tensor:  # [B, C, T]
    """SnakeBeta in one launch; x, alpha and beta share one dtype."""
    require_triton()
    kernel = _snake
    bsz, c, t = x.shape
    if alpha.shape != (c,) or beta.shape != (c,):
        raise ValueError(
            f"shape mismatch: x {tuple(x.shape)}, alpha {tuple(alpha.shape)}, beta {tuple(beta.shape)}"
        )
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(bsz, c, t, dtype=x.dtype, device=x.device)
    if out.numel():
        block = min(block_t, next_pow2(t))
        kernel[(bsz * c, triton_cdiv(t, block))](
            x,
            alpha,
            beta,
            out,
            c,
            t,
            x.stride(0),
            x.stride(1),
            BLOCK_T=block,
            RND=rnd(x.dtype),
            PRECISE=precise(),
            num_warps=num_warps,
        )
    return out


def fused_snake_forward(act: code2wav.SnakeBeta):
    """A `forward` for one SnakeBeta instance (its `step` calls `forward`, so streaming uses it too)."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        if (
            x.dim() != 3
            or x.dtype not in FLOATS
            or act.alpha.dtype != x.dtype
            or act.beta.dtype != x.dtype
            or x.requires_grad
        ):
            return snake_reference(act, x)
        return snake(x, act.alpha, act.beta)

    return mark(forward, "snake")


def install_snake(model: torch.nn.Module) -> int:
    """Patch every `code2wav.SnakeBeta` in `model`; returns the count."""
    require_triton()
    changed = 0
    for m in model.modules():
        if isinstance(m, code2wav.SnakeBeta):
            m.forward = fused_snake_forward(m)
            changed += 1
    return changed
