"""MoE expert computation for decode: a Triton kernel beside the plain-PyTorch functions it must equal.

All functions here share one signature, the seam `omni_rt.model.layers.SparseMoe` calls through:

    fn(hidden[N, H], topk_ids[N, k], topk_weights[N, k], gate_up_proj[E, 2I, H], down_proj[E, H, I]) -> [N, H]

with the packed-expert layout transformers >= 5 keeps in memory: `gate_up_proj[e]` holds the gate rows
first, then the up rows; expert e computes `down_proj[e] @ (silu(gate_up[:I] @ x) * (gate_up[I:] @ x))`,
and a token's output is the routing-weighted sum over its k experts.

Why a kernel: at decode (N of 1 to a few tokens) the MoE is bound by the bytes of the selected experts'
weights (8 experts x 3 x 2048 x 768 x 2 bytes = 75 MB per Thinker layer, 18 us at 4.2 TB/s), yet the
`torch._grouped_mm` path spends ~100 us per layer in a dozen launches (sort, gather, two grouped GEMMs
sized for prefill, scatter). The kernel streams each selected expert's rows once in two launches:
  1. `_gate_up_act`: one program per (token, slot, block of I rows): gate and up GEMV over H, then
     SiLU(gate) * up, written as fp32 activations [N*k, I] (a few KB).
  2. `_down_weighted`: one program per (token, block of H rows): for each of its k experts the down GEMV
     over I, scaled by the routing weight and summed in registers; no atomics, so the sum order is fixed
     and the result is bit-reproducible.
Tokens that pick the same expert read its rows again; at decode batch sizes those repeats mostly hit L2.

The Triton import is lazy so the CPU path never needs Triton; tests run the kernel in Triton's
interpreter (`TRITON_INTERPRET=1`) on the CPU.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

ExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
BACKENDS = ("loop", "grouped_mm", "triton")


# ----------------------------------------------------------------------------------------------------
# Plain-PyTorch functions (the truth the kernel is tested against, and the CPU path)
# ----------------------------------------------------------------------------------------------------
def moe_decode_reference(
    hidden: torch.Tensor,  # [N, H]
    topk_ids: torch.Tensor,  # [N, k] int
    topk_weights: torch.Tensor,  # [N, k]
    gate_up_proj: torch.Tensor,  # [E, 2I, H]
    down_proj: torch.Tensor,  # [E, H, I]
) -> torch.Tensor:  # [N, H]
    """The expert computation in fp32 on the gathered experts, cast back to hidden's dtype.

    fp32 throughout, so it is the exact value both the kernel (fp32 accumulation of bf16 weights) and
    the bf16 loop approximate; tests compare each against it with dtype-appropriate tolerances.
    """
    n, k = topk_ids.shape
    inter = down_proj.shape[-1]
    x = hidden.float()  # [N, H]
    w_gu = gate_up_proj[topk_ids].float()  # [N, k, 2I, H]
    gu = torch.einsum("nkoh,nh->nko", w_gu, x)  # [N, k, 2I]
    act = F.silu(gu[..., :inter]) * gu[..., inter:]  # [N, k, I]
    w_d = down_proj[topk_ids].float()  # [N, k, H, I]
    y = torch.einsum("nkhi,nki->nkh", w_d, act)  # [N, k, H]
    out = (y * topk_weights.float().unsqueeze(-1)).sum(dim=1)  # [N, H]
    return out.to(hidden.dtype)


def moe_loop(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
) -> torch.Tensor:
    """Per-(token, slot) loop in the weights' dtype: the reference implementation's arithmetic.

    Static shapes and no GPU->CPU sync (no `nonzero` over hit experts), so it can be captured in a CUDA
    graph; it launches ~5 kernels per (token, slot), which is why it is slow on a GPU.
    """
    n, k = topk_ids.shape
    inter = down_proj.shape[-1]
    out = torch.zeros_like(hidden)  # [N, H]
    for j in range(k):
        ids = topk_ids[:, j]  # [N]
        gu = torch.bmm(gate_up_proj[ids], hidden.unsqueeze(-1)).squeeze(-1)  # [N, 2I]
        act = F.silu(gu[:, :inter]) * gu[:, inter:]  # [N, I]
        y = torch.bmm(down_proj[ids], act.unsqueeze(-1)).squeeze(-1)  # [N, H]
        out = out + y * topk_weights[:, j, None].to(y.dtype)
    return out


def moe_grouped_mm(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
) -> torch.Tensor:
    """Sort (token, slot) pairs by expert and run two `torch._grouped_mm` calls: the prefill path.

    No GPU->CPU sync (group offsets from a scatter-add count), so it is graph-capturable. Needs
    contiguous weights whose rows are 16-byte aligned (true for every Qwen3-Omni shape).
    """
    n, k = topk_ids.shape
    e_count, two_i, h = gate_up_proj.shape
    inter = two_i // 2
    flat = topk_ids.reshape(-1)  # [N*k]
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert
    token_of = order // k  # [N*k]
    x = hidden[token_of]  # [N*k, H]
    # rows per expert by scatter_add: bincount sizes its output from the data, a GPU->CPU sync
    counts = torch.zeros(e_count, dtype=torch.int32, device=hidden.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))  # [E]
    offs = torch.cumsum(counts, 0).to(torch.int32)  # [E] end offset of each expert's group
    gu = torch._grouped_mm(x, gate_up_proj.transpose(1, 2), offs=offs)  # [N*k, 2I]
    act = F.silu(gu[:, :inter]) * gu[:, inter:]  # [N*k, I]
    y = torch._grouped_mm(act, down_proj.transpose(1, 2), offs=offs)  # [N*k, H]
    y = y * topk_weights.reshape(-1)[order, None].to(y.dtype)
    out = torch.zeros(n, h, dtype=torch.float32, device=hidden.device)
    out.index_add_(0, token_of, y.float())
    return out.to(hidden.dtype)


# ----------------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------------
@functools.cache
def _kernels():
    """Compile-on-first-use: importing Triton is deferred so CPU-only installs never need it."""
    import triton
    import triton.language as tl

    @triton.jit
    def _gate_up_act(
        x_ptr,  # [N, H]
        ids_ptr,  # [N*k]
        w_ptr,  # [E, 2I, H]
        act_ptr,  # [N*k, I] fp32
        H,
        INTER,
        stride_xn,
        stride_we,
        stride_wr,
        K: tl.constexpr,
        BLOCK_I: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        pair = tl.program_id(0)  # token * K + slot
        iblk = tl.program_id(1)
        tok = pair // K
        e = tl.load(ids_ptr + pair).to(tl.int64)
        rows = iblk * BLOCK_I + tl.arange(0, BLOCK_I)  # [BI]
        rmask = rows < INTER
        gate_base = w_ptr + e * stride_we + rows[:, None].to(tl.int64) * stride_wr  # [BI, 1]
        up_base = gate_base + INTER * stride_wr
        acc_g = tl.zeros((BLOCK_I,), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_I,), dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)  # [BH]
            cmask = cols < H
            x = tl.load(x_ptr + tok * stride_xn + cols, mask=cmask, other=0.0).to(tl.float32)
            m = rmask[:, None] & cmask[None, :]
            g = tl.load(gate_base + cols[None, :], mask=m, other=0.0).to(tl.float32)  # [BI, BH]
            u = tl.load(up_base + cols[None, :], mask=m, other=0.0).to(tl.float32)
            acc_g += tl.sum(g * x[None, :], axis=1)
            acc_u += tl.sum(u * x[None, :], axis=1)
        act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u  # SiLU(gate) * up, fp32
        tl.store(act_ptr + pair * INTER + rows, act, mask=rmask)

    @triton.jit
    def _down_weighted(
        act_ptr,  # [N*k, I] fp32
        ids_ptr,  # [N*k]
        tw_ptr,  # [N*k]
        w_ptr,  # [E, H, I]
        out_ptr,  # [N, H]
        H,
        INTER,
        stride_we,
        stride_wr,
        stride_on,
        K: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_I: tl.constexpr,
    ):
        tok = tl.program_id(0)
        hblk = tl.program_id(1)
        rows = hblk * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH] output features
        rmask = rows < H
        acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for j in range(K):  # fixed order over slots: deterministic sum
            pair = tok * K + j
            e = tl.load(ids_ptr + pair).to(tl.int64)
            wt = tl.load(tw_ptr + pair).to(tl.float32)
            base = w_ptr + e * stride_we + rows[:, None].to(tl.int64) * stride_wr  # [BH, 1]
            part = tl.zeros((BLOCK_H,), dtype=tl.float32)
            for i0 in range(0, INTER, BLOCK_I):
                cols = i0 + tl.arange(0, BLOCK_I)
                cmask = cols < INTER
                a = tl.load(act_ptr + pair * INTER + cols, mask=cmask, other=0.0)  # [BI] fp32
                w = tl.load(base + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
                part += tl.sum(w.to(tl.float32) * a[None, :], axis=1)
            acc += wt * part
        tl.store(out_ptr + tok * stride_on + rows, acc.to(out_ptr.dtype.element_ty), mask=rmask)

    return _gate_up_act, _down_weighted


def moe_decode_triton(
    hidden: torch.Tensor,  # [N, H]
    topk_ids: torch.Tensor,  # [N, k]
    topk_weights: torch.Tensor,  # [N, k]
    gate_up_proj: torch.Tensor,  # [E, 2I, H]
    down_proj: torch.Tensor,  # [E, H, I]
    *,
    block_i: int = 8,
    block_h: int = 512,
    block_h_down: int = 8,
    block_i_down: int = 256,
    num_warps: int = 4,
) -> torch.Tensor:  # [N, H]
    """The two-launch Triton expert computation; fp32 accumulation, output in hidden's dtype.

    Block sizes are tunable (scripts/gpu_kernels.py sweeps them on the H200); the defaults were the
    fastest of those swept, or within 4 % of it, at every Thinker and Talker decode shape measured but the
    Talker's batch 1, where 8 warps with block_h_down 16 were 12 % faster (docs/performance.md).
    """
    gate_up_act, down_weighted = _kernels()
    n, k = topk_ids.shape
    e_count, two_i, h = gate_up_proj.shape
    inter = two_i // 2
    if hidden.shape != (n, h) or down_proj.shape != (e_count, h, inter):
        raise ValueError(
            f"shape mismatch: hidden {tuple(hidden.shape)}, topk_ids {tuple(topk_ids.shape)}, "
            f"gate_up_proj {tuple(gate_up_proj.shape)}, down_proj {tuple(down_proj.shape)}"
        )
    # The kernels index the last dim with unit stride; experts and rows may be strided.
    hidden = hidden.contiguous()
    gate_up_proj = gate_up_proj if gate_up_proj.stride(-1) == 1 else gate_up_proj.contiguous()
    down_proj = down_proj if down_proj.stride(-1) == 1 else down_proj.contiguous()
    ids = topk_ids.reshape(-1).contiguous()  # [N*k]
    tw = topk_weights.reshape(-1).contiguous()  # [N*k]
    act = torch.empty(n * k, inter, dtype=torch.float32, device=hidden.device)  # [N*k, I]
    out = torch.empty(n, h, dtype=hidden.dtype, device=hidden.device)  # [N, H]
    if n == 0:
        return out
    gate_up_act[(n * k, triton_cdiv(inter, block_i))](
        hidden,
        ids,
        gate_up_proj,
        act,
        h,
        inter,
        hidden.stride(0),
        gate_up_proj.stride(0),
        gate_up_proj.stride(1),
        K=k,
        BLOCK_I=block_i,
        BLOCK_H=block_h,
        num_warps=num_warps,
    )
    down_weighted[(n, triton_cdiv(h, block_h_down))](
        act,
        ids,
        tw,
        down_proj,
        out,
        h,
        inter,
        down_proj.stride(0),
        down_proj.stride(1),
        out.stride(0),
        K=k,
        BLOCK_H=block_h_down,
        BLOCK_I=block_i_down,
        num_warps=num_warps,
    )
    return out


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ----------------------------------------------------------------------------------------------------
# The hook the engine uses
# ----------------------------------------------------------------------------------------------------
def triton_available() -> bool:
    """True when Triton imports and can run here: on a CUDA device, or on the CPU in interpreter mode."""
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    import os

    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def make_experts_fn(backend: str, *, decode_max_tokens: int = 16, prefill_kernel: bool = False) -> ExpertsFn:
    """The expert function for a `moe_backend` setting ("loop" | "grouped_mm" | "triton").

    "triton" runs the kernel when at most `decode_max_tokens` tokens come in (decode) and falls back to
    grouped GEMM for more (prefill), where a GEMV-per-pair kernel would re-read each expert per token;
    with `prefill_kernel` the larger calls run `kernels.moe_prefill` instead (a grouped GEMM that reads
    each selected expert once). The choice is by static shape, so it is fixed per captured graph and never
    syncs.
    """
    if backend == "loop":
        return moe_loop
    if backend == "grouped_mm":
        return moe_grouped_mm
    if backend != "triton":
        raise ValueError(f"unknown moe_backend {backend!r}; choose one of {BACKENDS}")
    if not triton_available():
        raise RuntimeError("moe_backend='triton' needs Triton and a CUDA device (or TRITON_INTERPRET=1)")
    prefill = None
    if prefill_kernel:
        from omni_rt.kernels.moe_prefill import moe_prefill_triton as prefill

    def experts(hidden, topk_ids, topk_weights, gate_up_proj, down_proj):
        if hidden.shape[0] <= decode_max_tokens:
            return moe_decode_triton(hidden, topk_ids, topk_weights, gate_up_proj, down_proj)
        if prefill is not None:
            return prefill(hidden, topk_ids, topk_weights, gate_up_proj, down_proj)
        if hidden.device.type == "cuda":
            return moe_grouped_mm(hidden, topk_ids, topk_weights, gate_up_proj, down_proj)
        return moe_loop(hidden, topk_ids, topk_weights, gate_up_proj, down_proj)

    experts.__name__ = "moe_triton_decode"
    return experts


def install(model: torch.nn.Module, backend: str, **kwargs) -> int:
    """Swap the expert function of every MoE block in `model`; returns how many blocks were changed.

    A block opts in by having an `experts_fn` attribute holding a function of this module's signature
    (`omni_rt.model.layers.SparseMoe` does). Applied from outside so the model file stays plain.
    """
    fn = make_experts_fn(backend, **kwargs)
    changed = 0
    for m in model.modules():
        if hasattr(m, "experts_fn"):
            m.experts_fn = fn
            changed += 1
    return changed
