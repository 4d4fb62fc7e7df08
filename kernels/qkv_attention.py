"""The code-predictor step's q/k/v projection and its attention in one launch (`CodeFrame`, few rows).

Why: at batch 1 a code-predictor layer was 5 launches, and its attention kernel (16 programs, no
weights) cost ~3 us of a ~18 us layer only to start after the q/k/v GEMV ended (docs/performance.md,
per-kernel figures of 2026-12-05). Here the GEMV's programs count themselves in per query head
(`_triton.arrive_last`) when their tile is stored, and the last of the 3 x D / BN programs that make a
head's q, k and v rows runs that head's attention (`code_frame._attend`) for every batch row: the same
work, in the same number of programs, on the same values (the tiles are read back as the separate kernel
reads them), so the codes and cache rows equal the two-launch path's bit for bit.

Few rows only (the GEMV path, one row tile): a program that arrives last for a head then runs that
head for at most 4 rows; with more rows the separate attention kernel spreads them over more programs.
"""

from __future__ import annotations

import torch
from omni_rt.kernels._common import next_pow2, precise, rnd

try:  # the kernel needs Triton
    import triton
    import triton.language as tl
    from omni_rt.kernels._triton import arrive_last
    from omni_rt.kernels.code_frame import _attend, _linear
except ImportError:  # pragma: no cover - depends on the machine
    triton = None

if triton is not None:

    @triton.jit
    def _qkv_attention(
        x_ptr, idx_ptr, w_ptr, g_ptr, qkv_ptr, M, N, K, stride_x, stride_w, stride_qkv, eps, inv_k,
        qw_ptr, kw_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, o_ptr,
        count_ptr,  # [HQ] int32, 0 between launches: each query head's programs arrived
        p0, inv_d, scale, stride_o, stride_cs, stride_ch, stride_cl,
        NORM: tl.constexpr, X_GATHER: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
        F32_DOT: tl.constexpr, RND: tl.constexpr, PRECISE: tl.constexpr, SINGLE: tl.constexpr,
        PDL: tl.constexpr, T: tl.constexpr, HQ: tl.constexpr, KV: tl.constexpr, REP: tl.constexpr,
        D: tl.constexpr, BL: tl.constexpr, HAS_NORM: tl.constexpr, RND_C: tl.constexpr,
    ):  # fmt: skip
        # the packed q/k/v GEMV's tile (the input norm fused), as `_linear` alone
        _linear(
            x_ptr, idx_ptr, w_ptr, g_ptr, qkv_ptr, qkv_ptr, M, N, K, stride_x, stride_w, 0, stride_qkv, 0,
            eps, inv_k, NORM, X_GATHER, False, 0, BM, BN, BK, False, F32_DOT, RND, PRECISE, SINGLE, PDL,
        )  # fmt: skip
        # the heads this tile feeds: a q tile its head; a k or v tile every query head of its kv group
        n0 = tl.program_id(0) * BN
        is_q = n0 < HQ * D
        first = tl.where(is_q, n0 // D, (n0 - HQ * D) // D % KV * REP)
        for j in range(tl.where(is_q, 1, REP)):
            h = first + j
            if arrive_last(count_ptr + h, 3 * (D // BN), PRECISE):  # q, k and v of head h are stored
                for b in range(M // T):
                    _attend(
                        tl.full((), 0, tl.int64) + b, h, qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, o_ptr,
                        p0, eps, inv_d, scale, stride_qkv, stride_o, stride_cs, stride_ch, stride_cl,
                        T, HQ, KV, REP, D, BL, HAS_NORM, RND, RND_C, PRECISE, ".cg",
                    )  # fmt: skip


def fits(m: int, blocks: dict[str, int], head_dim: int, small_m: int) -> bool:
    """Whether a step of m rows can take the one-launch path: the GEMV path (m <= small_m) in one row tile,
    with q/k/v tiles that never straddle two heads."""
    return m <= small_m and m <= blocks["BM"] and head_dim % blocks["BN"] == 0


def qkv_attention(frame, x, w, norm, idx, gather: bool, q_w, k_w, cache, layer: int, b: int, t: int, p0: int,
                  blocks: dict[str, int]) -> torch.Tensor:  # fmt: skip
    """`frame._linear("qkv", ...)` then `frame._attention(...)` in one launch -> attention out [b * t, HQ * D].
    blocks: the q/k/v GEMV's block shape (BM, BN, BK, num_warps), as `CodeFrame._linear` picks it."""
    cfg = frame.cfg
    hq, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    m, k = b * t, w.shape[1]
    n = w.shape[0]
    bm, bn, bk = blocks["BM"], blocks["BN"], min(blocks["BK"], next_pow2(k))
    qkv = torch.empty(m, n, dtype=w.dtype, device=w.device)
    out = torch.empty(m, hq * d, dtype=w.dtype, device=w.device)
    kc, vc = cache.k[layer], cache.v[layer]  # [S, KV, L, D]
    _qkv_attention[(triton.cdiv(n, bn), 1)](
        x, idx if idx is not None else qkv, w, norm, qkv, m, n, k, x.stride(0), w.stride(0), qkv.stride(0),
        frame.eps, 1.0 / k,
        q_w if q_w is not None else qkv, k_w if k_w is not None else qkv, frame.cos, frame.sin, kc, vc, out,
        frame.arrivals[layer], p0, 1.0 / d, d**-0.5, out.stride(0), kc.stride(0), kc.stride(1), kc.stride(2),
        NORM=True, X_GATHER=gather, BM=bm, BN=bn, BK=bk, F32_DOT=w.dtype == torch.float32 or not precise(),
        RND=frame.rnd, PRECISE=precise(), SINGLE=k <= bk, PDL=frame.pdl, T=t, HQ=hq, KV=kv, REP=hq // kv,
        D=d, BL=max(next_pow2(p0), 2), HAS_NORM=q_w is not None, RND_C=rnd(kc.dtype),
        num_warps=blocks["num_warps"], **frame.launch,
    )  # fmt: skip
    return out
