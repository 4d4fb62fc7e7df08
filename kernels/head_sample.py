"""The code predictor's head GEMV and the choice of its code in one launch (`CodeFrame`, few rows).

Why: a code-predictor step ended in two launches, the head's GEMV (final norm + lm_head) and the
sampler (`sample._sample`) or torch's argmax, and at batch 1 each launch costs ~3 us whatever its work:
15 a frame, ~45 us of a frame ~0.35 ms over its 1.75 ms target sampled (docs/performance.md). Here the
GEMV's programs count themselves in when their logits tile is stored (`_triton.arrive_last`), and the
last one chooses every row's code: greedily (the first index of the maximum, as torch.argmax) or by
`sample._choose`, the fused sampler's own code. The logits still go through memory and are read back as
the separate kernel reads them, so the codes equal the two launches' bit for bit.

Few rows only (the GEMV path, one row tile); vocabularies up to `sample.MAX_VOCAB` (one row in one
program's registers). The caller's `sample` must be `talker.greedy` or a fused `sampling.FrameDraws`.
"""

from __future__ import annotations

import torch
from omni_rt.kernels import sample as sample_kernel
from omni_rt.kernels._common import next_pow2, precise

try:  # the kernel needs Triton
    import triton
    import triton.language as tl
    from omni_rt.kernels._triton import arrive_last
    from omni_rt.kernels.code_frame import _linear
    from omni_rt.kernels.sample import _choose
except ImportError:  # pragma: no cover - depends on the machine
    triton = None

if triton is not None:

    @triton.jit
    def _head_choose(
        x_ptr, w_ptr, g_ptr, y_ptr, M, N, K, stride_x, stride_w, stride_y, eps, inv_k,
        count_ptr,  # [1] int32, 0 between launches: the programs whose logits tile is stored
        slots_ptr, keys_ptr, temp_ptr, topk_ptr, topp_ptr, pen_ptr, dos_ptr, seed_ptr, seen_ptr, supp_ptr,
        out_ptr,  # [M] int64: the codes
        key_off,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, F32_DOT: tl.constexpr, RND: tl.constexpr,
        PRECISE: tl.constexpr, SINGLE: tl.constexpr, PDL: tl.constexpr,
        GREEDY: tl.constexpr,  # the argmax alone: no sampler tables (talker.greedy)
        STAGE: tl.constexpr, HAS_SEEN: tl.constexpr, HAS_SUPP: tl.constexpr, BLOCK_V: tl.constexpr,
        KEY16: tl.constexpr, U32: tl.constexpr,
    ):  # fmt: skip
        # the head's logits tile (the final norm fused), as `_linear` alone
        _linear(
            x_ptr, y_ptr, w_ptr, g_ptr, y_ptr, y_ptr, M, N, K, stride_x, stride_w, 0, stride_y, 0, eps, inv_k,
            True, False, False, 0, BM, BN, BK, False, F32_DOT, RND, PRECISE, SINGLE, PDL,
        )  # fmt: skip
        if arrive_last(count_ptr, tl.num_programs(0), PRECISE):  # every tile of every row is stored
            for r in range(M):
                row = tl.full((), 0, tl.int64) + r  # the interpreter's loop variable is a Python int
                if GREEDY:
                    v = tl.arange(0, BLOCK_V)
                    x = tl.load(
                        y_ptr + row * stride_y + v, mask=v < N, other=float("-inf"), cache_modifier=".cg"
                    )
                    choice = tl.argmax(x.to(tl.float32), axis=0, tie_break_left=True)
                    tl.store(out_ptr + row, choice.to(tl.int64))
                else:
                    _choose(
                        row, y_ptr, slots_ptr, keys_ptr, temp_ptr, topk_ptr, topp_ptr, pen_ptr, dos_ptr,
                        seed_ptr, seen_ptr, supp_ptr, out_ptr, N, stride_y, key_off,
                        STAGE, HAS_SEEN, HAS_SUPP, BLOCK_V, PRECISE, KEY16, U32, ".cg",
                    )  # fmt: skip


def _greedy(sample) -> bool:
    from omni_rt.model.talker import greedy

    return sample is greedy


def fits(m: int, vocab: int, sample, blocks: dict[str, int], small_m: int) -> bool:
    """Whether a head of `vocab` ids at m rows can choose in its own launch: the GEMV path (m <= small_m)
    in one row tile of `blocks` (the head's, as `CodeFrame._blocks` picks them), a row in one program's
    registers, and a `sample` this launch can make (greedy, or a fused `FrameDraws`)."""
    from omni_rt.model.sampling import FrameDraws

    drawn = _greedy(sample) or (isinstance(sample, FrameDraws) and sample.fused)
    return drawn and m <= small_m and m <= blocks["BM"] and sample_kernel.fits(vocab)


def head_choose(frame, x, w, m: int, stride_x: int, sample, blocks: dict[str, int]) -> torch.Tensor:
    """`frame._linear("head", x, w, m, norm=frame.final_norm, stride_x=stride_x)` then `sample(logits)`
    in one launch -> codes [m] int64. blocks: the head GEMV's block shape (BM, BN, BK, num_warps)."""
    n, k = w.shape
    bm, bn, bk = blocks["BM"], blocks["BN"], min(blocks["BK"], next_pow2(k))
    logits = torch.empty(m, n, dtype=w.dtype, device=w.device)  # written, then read back by the chooser
    out = torch.empty(m, dtype=torch.int64, device=w.device)
    if _greedy(sample):
        slots = keys = out
        tables = (out,) * 8
        flags = {"STAGE": 0, "HAS_SEEN": False, "HAS_SUPP": False, "KEY16": False, "U32": False}
        key_off = 0
    else:  # a fused FrameDraws: this launch makes its next draw
        slots, keys, key_off = sample.slots, sample.keys, sample.next_offset()
        tables, flags = sample_kernel.sampler_tables(sample.sampler, w.dtype, out)
    _head_choose[(triton.cdiv(n, bn), 1)](
        x, w, frame.final_norm, logits, m, n, k, stride_x, w.stride(0), logits.stride(0), frame.eps, 1.0 / k,
        frame.head_arrivals, slots, keys, *tables, out, key_off,
        BM=bm, BN=bn, BK=bk, F32_DOT=w.dtype == torch.float32 or not precise(), RND=frame.rnd,
        PRECISE=precise(), SINGLE=k <= bk, PDL=frame.pdl, GREEDY=_greedy(sample), BLOCK_V=next_pow2(n),
        num_warps=blocks["num_warps"], **flags, **frame.launch,
    )  # fmt: skip
    return out
