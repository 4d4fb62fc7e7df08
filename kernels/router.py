"""Fused MoE router for decode: gate GEMV, fp32 softmax, top-k, renormalisation and cast in one launch.

Why: `SparseMoe.route` is a gate GEMM, a softmax, a top-k (a radix select and a sort), a sum, a division
and a cast: 6-8 launches of ~2.6 us per layer for a few rows (docs/performance.md). One program per row
here holds the E <= 128 logits in registers and does all of it.

Numbers, against `layers.SparseMoe.route` (the reference, called as is):
- logits: with `fuse_gate=True` the kernel computes x . gate_e in fp32 and rounds to the activation dtype
  (as F.linear's output is). cuBLAS sums in another order, so a bf16 logit can differ by one ulp where the
  fp32 sum lies near a rounding boundary; the ids then differ only if that logit is within an ulp of the
  k-th largest. With `fuse_gate=False` the logits come from the module's own `gate` (one cuBLAS launch
  more) and the ids are exactly route's.
- softmax: max, `exp(l - max)`, sum, division, in fp32 (libdevice `expf` on the GPU, as PyTorch's).
  The sum is a tree sum in another order, so probabilities may differ by an fp32 ulp; the ids cannot
  (equal bf16 logits give bit-equal probabilities here, different ones differ by far more than an ulp).
- top-k: largest probability first; among equal probabilities the LOWER expert index first. That is
  torch.topk's rule on CUDA at the selection boundary (its radix select keeps the first-seen equal
  values, in index order). Within the k selected, torch.topk orders equal values by an unstable
  bitonic sort (CUDA) or std::nth_element (CPU): same ids as a set, possibly swapped between slots. Equal
  values have equal weights, so a swap only changes the MoE's fp32 summation order.
- renormalise (`norm_topk_prob`): divide by the sum of the k weights (fp32), then round to the activation
  dtype, as route's `.to(logits.dtype)`.
NaN logits are not handled (torch.topk ranks NaN first; here a NaN row gives undefined ids).
"""

from __future__ import annotations

import torch
from omni_rt.kernels._common import FLOATS, mark, next_pow2, precise, require_triton, rnd

from omni_rt.model import layers


def route_reference(moe: layers.SparseMoe, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`layers.SparseMoe.route` itself (the class's, even when the instance's route is patched)."""
    return layers.SparseMoe.route(moe, x)


try:  # the kernels need Triton; the references and the hooks' plain fallbacks do not
    import triton
    import triton.language as tl
    from omni_rt.kernels._triton import exp_f32, round_to
except ImportError:  # pragma: no cover - depends on the machine
    triton = None

if triton is not None:

    @triton.jit
    def _route(
        x_ptr,  # [N, H]
        g_ptr,  # [E, H] gate weight
        l_ptr,  # [N, E] precomputed logits (FUSE_GATE=False)
        w_ptr,  # [N, K] out: weights
        i_ptr,  # [N, K] out: int64 expert ids
        H,
        E,
        stride_x,
        stride_g,
        stride_l,
        K: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_H: tl.constexpr,
        FUSE_GATE: tl.constexpr,
        NORM: tl.constexpr,
        RND: tl.constexpr,  # the logits' dtype (F.linear's output): also the weights' output dtype
        PRECISE: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, BLOCK_E)
        em = e < E
        if FUSE_GATE:
            acc = tl.zeros((BLOCK_E,), dtype=tl.float32)
            for h0 in range(0, H, BLOCK_H):
                hh = h0 + tl.arange(0, BLOCK_H)
                hm = hh < H
                xv = tl.load(x_ptr + row * stride_x + hh, mask=hm, other=0.0).to(tl.float32)
                g = tl.load(
                    g_ptr + e[:, None].to(tl.int64) * stride_g + hh[None, :],
                    mask=em[:, None] & hm[None, :],
                    other=0.0,
                ).to(tl.float32)  # [BE, BH]
                acc += tl.sum(g * xv[None, :], axis=1)
            logit = round_to(acc, RND)
        else:
            logit = tl.load(l_ptr + row * stride_l + e, mask=em, other=0.0).to(tl.float32)
        logit = tl.where(em, logit, float("-inf"))
        ex = exp_f32(logit - tl.max(logit, axis=0), PRECISE)
        ex = tl.where(em, ex, 0.0)
        p = tl.div_rn(ex, tl.sum(ex, axis=0))  # IEEE division, as PyTorch's (`/` would be div.full)
        p = tl.where(em, p, -1.0)  # below every probability: padding is never picked
        kk = tl.arange(0, BLOCK_K)
        top_w = tl.zeros((BLOCK_K,), dtype=tl.float32)
        top_i = tl.zeros((BLOCK_K,), dtype=tl.int32)
        for j in tl.static_range(K):
            best = tl.max(p, axis=0)
            idx = tl.min(tl.where(p == best, e, BLOCK_E), axis=0)  # ties: the lower index
            top_w = tl.where(kk == j, best, top_w)
            top_i = tl.where(kk == j, idx, top_i)
            p = tl.where(e == idx, -1.0, p)
        if NORM:
            top_w = tl.div_rn(top_w, tl.sum(top_w, axis=0))  # slots >= K hold 0: a sum over the k picked
        km = kk < K
        tl.store(w_ptr + row * K + kk, round_to(top_w, RND).to(w_ptr.dtype.element_ty), mask=km)
        tl.store(i_ptr + row * K + kk, top_i.to(tl.int64), mask=km)


def fused_route(
    x: torch.Tensor,  # [N, H]
    gate_weight: torch.Tensor,  # [E, H]
    top_k: int,
    norm_topk_prob: bool,
    *,
    logits: torch.Tensor | None = None,  # [N, E]: given, the gate GEMV is skipped
    block_h: int = 32,
    num_warps: int = 8,
) -> tuple[torch.Tensor, torch.Tensor]:  # (weights [N, K] in the logits' dtype, ids [N, K] int64)
    """The router of `layers.SparseMoe.route` in one launch (see the module doc for the numbers).

    Defaults: the [128, block_h] gate tile in 8 warps compiles for sm_90 to 117 registers without
    spills; block_h 64 in 4 warps spilled 160 bytes (ptxas, Triton 3.9). Not yet timed on the GPU
    (`scripts/gpu_fused.py` sweeps a few)."""
    require_triton()
    kernel = _route
    n, h = x.shape
    e = gate_weight.shape[0]
    if gate_weight.shape[1] != h or not 0 < top_k <= e:
        raise ValueError(
            f"shape mismatch: x {tuple(x.shape)}, gate {tuple(gate_weight.shape)}, top_k {top_k}"
        )
    x = x if x.stride(-1) == 1 else x.contiguous()
    gate_weight = gate_weight if gate_weight.stride(-1) == 1 else gate_weight.contiguous()
    dtype = torch.promote_types(x.dtype, gate_weight.dtype) if logits is None else logits.dtype
    if logits is not None:
        logits = logits.contiguous()
    w = torch.empty(n, top_k, dtype=dtype, device=x.device)
    ids = torch.empty(n, top_k, dtype=torch.int64, device=x.device)
    if n == 0:
        return w, ids
    block_e = next_pow2(e)
    kernel[(n,)](
        x,
        gate_weight,
        logits if logits is not None else x,  # unread when the gate is fused
        w,
        ids,
        h,
        e,
        x.stride(0),
        gate_weight.stride(0),
        logits.stride(0) if logits is not None else 0,
        K=top_k,
        BLOCK_K=next_pow2(top_k),
        BLOCK_E=block_e,
        BLOCK_H=min(block_h, next_pow2(h)),
        FUSE_GATE=logits is None,
        NORM=norm_topk_prob,
        RND=rnd(dtype),
        PRECISE=precise(),
        num_warps=num_warps,
    )
    return w, ids


def fused_route_method(moe: layers.SparseMoe, *, fuse_gate: bool = True, max_rows: int | None = 16):
    """A `route` for one SparseMoe instance: the kernel for up to `max_rows` rows (decode), else route's
    own code (prefill, where cuBLAS's GEMM and one softmax over many rows are the better split)."""

    def route(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = moe.gate.weight
        if (
            (max_rows is not None and x.shape[0] > max_rows)
            or x.dtype != w.dtype
            or x.dtype not in FLOATS
            or x.requires_grad
        ):
            return route_reference(moe, x)
        logits = None if fuse_gate else moe.gate(x)
        return fused_route(x, w, moe.top_k, moe.norm_topk_prob, logits=logits)

    return mark(route, "router")


def install_router(model: torch.nn.Module, *, fuse_gate: bool = True, max_rows: int | None = 16) -> int:
    """Patch `route` of every `layers.SparseMoe` in `model` (Thinker and Talker); returns the count."""
    require_triton()
    changed = 0
    for m in model.modules():
        if isinstance(m, layers.SparseMoe):
            m.route = fused_route_method(m, fuse_gate=fuse_gate, max_rows=max_rows)
            changed += 1
    return changed
