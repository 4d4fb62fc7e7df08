"""Decode attention over the static slot cache in one launch, for `layers.Attention.attn_fn`.

Why: `layers.attend` gathers each row's cache (`k_cache[slots, :, :kv_len]`, one copy for k and one for
v), then runs SDPA with a mask (cuDNN: 14 us per Thinker layer for one query over <= 512 rows,
docs/performance.md), 3-5 launches per layer. This kernel reads the cache rows of each slot in place:
one program per (token, kv head) carries that kv head's `rep` query heads (GQA), walks the rows
0..min(position, kv_len - 1) in blocks with an online softmax (fp32), and writes [B, Hq, T, D].

Numbers: scores and the softmax in fp32, probabilities rounded to the value dtype before the P.V product
(as flash attention does); SDPA's kernels block and round differently, so bf16 outputs agree to about
one bf16 ulp, not bit for bit (already true between SDPA's own backends and kv_len buckets, see
`layers.attend`). Rows above a query's position, and beyond kv_len, get no weight, as under the mask.

The hook sets `Attention.attn_fn`, the seam layers.py has for this. Decode steps (one token a row) run
here at any batch size; calls of several tokens a row and more than `max_rows` token rows (a prefill)
go to `layers.attend`. (Until 2026-12-05 any call of more than 16 rows went there, so at 32 and 64
conversations the Thinker's and the Talker's steps of 17+ rows gathered every row's cache twice a layer
and ran a masked SDPA: ~75 MB a Thinker layer at 24 rows and kv_len 512, against the ~20 MB this reads.)
"""

from __future__ import annotations

import torch
from omni_rt.kernels._common import FLOATS, mark, next_pow2, precise, require_triton, rnd

from omni_rt.model import layers

try:  # the kernel needs Triton; the reference and the hook's plain fallback do not
    import triton
    import triton.language as tl
    from omni_rt.kernels._triton import round_to
except ImportError:  # pragma: no cover - depends on the machine
    triton = None

if triton is not None:

    @triton.jit
    def _decode_attention(
        q_ptr,  # [B, HQ, T, D]
        kc_ptr,  # [S, KV, L, D]
        vc_ptr,  # [S, KV, L, D]
        slots_ptr,  # [B]
        pos_ptr,  # [B*T]
        o_ptr,  # [B, HQ, T, D] contiguous
        T,
        kv_len,
        scale,
        stride_qb,
        stride_qh,
        stride_qt,
        stride_cs,
        stride_ch,
        stride_cl,
        HQ: tl.constexpr,
        REP: tl.constexpr,  # query heads per kv head
        D: tl.constexpr,
        BLOCK_M: tl.constexpr,  # REP padded to a power of two >= 16 (tl.dot's smallest tile)
        BLOCK_N: tl.constexpr,  # cache rows per step
        F32_DOT: tl.constexpr,  # products in fp32 (IEEE, not TF32): fp32 inputs, or the interpreter
        RND_V: tl.constexpr,  # the value dtype: where the probabilities are rounded before P.V
    ):
        tok = tl.program_id(0)  # b * T + t
        kvh = tl.program_id(1)
        b = tok // T
        t = tok % T
        slot = tl.load(slots_ptr + b).to(tl.int64)
        n_keys = tl.minimum(tl.load(pos_ptr + tok).to(tl.int32) + 1, kv_len)  # rows 0..pos, below kv_len
        r = tl.arange(0, BLOCK_M)
        rm = r < REP
        d = tl.arange(0, D)
        heads = kvh * REP + r  # head h uses kv head h // REP, as `attend` folds them
        q_off = b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + t * stride_qt + d[None, :]
        q = tl.load(q_ptr + q_off, mask=rm[:, None], other=0.0)  # [M, D]
        base = slot * stride_cs + kvh * stride_ch
        m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
        for start in range(0, n_keys, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N)
            jm = j < n_keys
            kv_off = base + j[:, None].to(tl.int64) * stride_cl + d[None, :]
            k = tl.load(kc_ptr + kv_off, mask=jm[:, None], other=0.0).to(q.dtype)  # [N, D]
            if F32_DOT:
                s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(jm[None, :], s * scale, float("-inf"))  # [M, N]
            m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every block has a row below n_keys
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(vc_ptr + kv_off, mask=jm[:, None], other=0.0).to(q.dtype)  # [N, D]
            p_v = round_to(p, RND_V)  # exactly representable in v's dtype
            if F32_DOT:
                pv = tl.dot(p_v, v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p_v.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        out = acc / l_i[:, None]
        o_off = ((b.to(tl.int64) * HQ + heads[:, None]) * T + t) * D + d[None, :]
        tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=rm[:, None])


def decode_attention(
    q: torch.Tensor,  # [B, Hq, T, D] rotated
    k_cache: torch.Tensor,  # [S, KV, L, D] this layer's, new rows written
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # [B]
    positions: torch.Tensor,  # [B, T]
    mask: torch.Tensor | None,  # unused: positions and kv_len say the same
    kv_len: int,
    *,
    block_n: int = 64,
    num_warps: int = 8,
) -> torch.Tensor:  # [B, Hq, T, D]
    """`layers.attend` (same signature, so it fits `Attention.attn_fn`) in one launch.

    Defaults: 64 rows per step in 8 warps compile for sm_90 (D 128) to 182 registers without spills; in
    4 warps they spilled (ptxas, Triton 3.9). Not yet timed on the GPU (`scripts/gpu_fused.py` sweeps)."""
    require_triton()
    b, hq, t, d = q.shape
    _, kv, _, _ = k_cache.shape
    if hq % kv or d & (d - 1) or k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError(f"unsupported shapes: q {tuple(q.shape)}, cache {tuple(k_cache.shape)}")
    rep = hq // kv
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty(b, hq, t, d, dtype=q.dtype, device=q.device)
    _decode_attention[(b * t, kv)](
        q,
        k_cache,
        v_cache,
        slots.contiguous(),
        positions.reshape(b * t).contiguous(),
        out,
        t,
        kv_len,
        d**-0.5,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        HQ=hq,
        REP=rep,
        D=d,
        BLOCK_M=max(16, next_pow2(rep)),
        BLOCK_N=block_n,
        # the interpreter's tl.dot is wrong for bf16 (Triton 3.9 multiplies the raw bits): there the same
        # bf16 values are multiplied in fp32, which is what the tensor cores do too (exact products)
        F32_DOT=q.dtype == torch.float32 or not precise(),
        RND_V=rnd(q.dtype),
        num_warps=num_warps,
    )
    return out


def make_attn_fn(max_rows: int | None = 16) -> layers.AttnFn:
    """An `Attention.attn_fn`: the kernel for decode steps (one token a row, any batch) and for calls of at
    most `max_rows` token rows; `layers.attend` for longer calls of several tokens a row (prefill)."""

    def attn_fn(q, k_cache, v_cache, slots, positions, mask, kv_len):
        b, _, t, d = q.shape
        if (
            (max_rows is not None and t > 1 and b * t > max_rows)
            or q.dtype not in FLOATS
            or k_cache.dtype != q.dtype
            or d & (d - 1)
            or q.requires_grad
        ):
            return layers.attend(q, k_cache, v_cache, slots, positions, mask, kv_len)
        return decode_attention(q, k_cache, v_cache, slots, positions, mask, kv_len)

    return mark(attn_fn, "decode_attention")


def install_decode_attention(model: torch.nn.Module, max_rows: int | None = 16) -> int:
    """Set `attn_fn` of every `layers.Attention` in `model`; returns the count."""
    require_triton()
    fn = make_attn_fn(max_rows)
    changed = 0
    for m in model.modules():
        if isinstance(m, layers.Attention):
            m.attn_fn = fn
            changed += 1
    return changed
