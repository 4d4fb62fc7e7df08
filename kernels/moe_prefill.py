"""MoE expert computation for prefill (16-512 token rows): each selected expert's weights read once.

Same signature and weight layout as the expert functions in `moe_decode` (the seam `SparseMoe` calls):

    moe_prefill_triton(hidden[N, H], topk_ids[N, k], topk_weights[N, k],
                       gate_up_proj[E, 2I, H], down_proj[E, H, I]) -> [N, H]

Why: at prefill sizes nearly every expert is touched (1 - (120/128)^57 = 97 % of the Thinker's), so the
MoE is bound by reading each touched expert's 3*H*I weights once. `moe_decode_triton` re-reads an expert
per (token, slot) pair; `moe_grouped_mm` reads each once but costs a dozen launches per layer (argsort,
gathers, two grouped GEMMs, scatter). Here, four launches, all with shapes fixed by (N, k, E), no
GPU->CPU sync, so the whole thing can be captured in a CUDA graph:

  1. `_align` (grid E): every program histograms all N*k expert ids (so each knows every expert's count),
     pads each expert's count up to a multiple of BLOCK_M, and writes its own expert's pair indices, in
     pair order (stable), into the padded expert-sorted layout, plus the block table for its blocks:
     `block_expert[b]` (-1 for unused blocks) and `block_rows[b]` (valid rows, 0..BLOCK_M). The number of
     row blocks has the static bound cdiv(N*k, BLOCK_M) + min(N*k, E); unused blocks exit at once in
     the GEMM launches.
  2. `_gate_up_act` (grid blocks x I/BLOCK_N): one row block of one expert against a BLOCK_N slice of its
     gate rows and the matching up rows: two tl.dot accumulations over H, then SiLU(gate) * up, written
     as the model dtype into the padded layout [blocks*BLOCK_M, I].
  3. `_down` (grid blocks x H/BLOCK_N): the row block's activations against a BLOCK_N slice of down rows,
     scaled by each pair's routing weight, written to that pair's row of y [N*k, H] (pair = token*k+slot).
  4. `_combine` (grid N x H/BLOCK_H): out[t] = sum over slots j = 0..k-1 of y[t*k + j], in fp32, in slot
     order: no atomics, so the result is bit-reproducible run to run.
The block index is the fastest-varying grid axis, so the row blocks of one expert (an expert with more
than BLOCK_M pairs) run side by side on the same weight tile, and the repeat reads hit L2.

Numbers: the rounding points are `moe_grouped_mm`'s (bf16 on the GPU):
  - gate and up: fp32 accumulation (tl.dot), each rounded to the model dtype, as grouped_mm's output is;
  - SiLU in fp32 on the rounded gate (`g / (1 + exp(-g))`, IEEE division, libdevice exp on the GPU, as
    PyTorch's CUDA silu), rounded; times the rounded up, rounded (PyTorch's bf16 mul);
  - down: fp32 accumulation, rounded to the model dtype (grouped_mm's output), times the routing weight
    (rounded to the model dtype first, as `.to(y.dtype)`), rounded (PyTorch's bf16 mul);
  - combine: the k rows summed in fp32 (grouped_mm: index_add_ into fp32, in arrival order), rounded
    once to the model dtype.
So only the order of the sums differs from grouped_mm (tensor-core K order in the GEMMs, slot order in
the combine): results agree to within a few bf16 ulps, most elements bit-equal. In fp32 the dots run in
IEEE fp32 (`input_precision="ieee"`, not TF32) and every rounding is the identity.

Rounding uses `_triton.round_to` (integer round-to-nearest-even) so that Triton's interpreter, whose
fp32->bf16 cast truncates, gives the GPU's bits; the CPU tests run the kernels there (TRITON_INTERPRET=1).
The interpreter's tl.dot also multiplies 16-bit floats as their raw bit patterns (numpy has no bf16), so
there the operands are widened to fp32 first (`_mma`, exact); compiled code feeds them to the tensor cores.
Only Triton 3.6 features are used (tl.histogram without its newer mask=, tl.cumsum, tl.dot's acc= and
input_precision=); the bf16 kernels compile for sm_90a with Triton 3.6 and 3.9 without register spills.
"""

from __future__ import annotations

import torch
from omni_rt.kernels._common import next_pow2, precise, require_triton, rnd

try:  # the kernels need Triton; importing this module does not
    import triton
    import triton.language as tl
    from omni_rt.kernels._triton import exp_f32, round_to
except ImportError:  # pragma: no cover - depends on the machine
    triton = None

# Default tile sizes (not yet timed on the H200: scripts/gpu_moe_prefill.py sweeps a few).
DEFAULT_CONFIG = dict(
    block_m=16, block_n=64, block_k=128, block_n_down=64, block_k_down=128, num_warps=4, num_stages=4
)

if triton is not None:

    @triton.jit
    def _mma(a, b, acc, IEEE: tl.constexpr, UPCAST: tl.constexpr):
        """acc + a @ b in fp32. UPCAST (the interpreter, 16-bit operands): numpy has no bf16, and the
        interpreter's dot multiplies the raw 16-bit patterns, so operands go to fp32 first (exact; the
        products of 16-bit floats are exact in fp32 on tensor cores too)."""
        if UPCAST:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        elif IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        return acc

    @triton.jit
    def _align(
        ids_ptr,  # [P] int: expert of each (token, slot) pair, P = N*k
        sorted_ptr,  # [NB*BM] int32 out: pair index of each row of the padded expert-sorted layout
        bexp_ptr,  # [NB] int32 out: expert of each row block, -1 unused
        brows_ptr,  # [NB] int32 out: valid rows of each row block
        P,
        NB,
        BM: tl.constexpr,
        BLOCK_P: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_B: tl.constexpr,
    ):
        e = tl.program_id(0)
        eidx = tl.arange(0, BLOCK_E)
        # every expert's count (each program redoes this: N*k <= 4096 ids, a few histograms)
        counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
        for p0 in range(0, P, BLOCK_P):
            offs = p0 + tl.arange(0, BLOCK_P)
            m = offs < P
            v = tl.load(ids_ptr + offs, mask=m, other=0).to(tl.int32)
            counts += tl.histogram(v, BLOCK_E)
            # masked lanes were counted in bin 0 (histogram's mask= argument is newer than Triton 3.6)
            counts -= tl.where(eidx == 0, tl.sum((offs >= P).to(tl.int32), axis=0), 0)
        nblk = (counts + BM - 1) // BM  # [BE] row blocks per expert
        end_blk = tl.cumsum(nblk, axis=0)  # [BE] inclusive
        total = tl.sum(nblk, axis=0)
        count_e = tl.sum(tl.where(eidx == e, counts, 0), axis=0)
        start_e = tl.sum(tl.where(eidx == e, end_blk - nblk, 0), axis=0)  # first block of expert e
        # expert e's pairs, in pair order, at rows start_e*BM + rank
        run = tl.sum(tl.zeros((BLOCK_P,), dtype=tl.int32), axis=0)
        for p0 in range(0, P, BLOCK_P):
            offs = p0 + tl.arange(0, BLOCK_P)
            v = tl.load(ids_ptr + offs, mask=offs < P, other=-1).to(tl.int32)
            hit = (v == e).to(tl.int32)
            rank = run + tl.cumsum(hit, axis=0) - 1
            tl.store(sorted_ptr + start_e * BM + rank, offs, mask=hit != 0)
            run += tl.sum(hit, axis=0)
        # the block table for expert e's blocks; program 0 also marks the unused tail
        nb_e = (count_e + BM - 1) // BM
        for j0 in range(0, nb_e, BLOCK_B):
            j = j0 + tl.arange(0, BLOCK_B)
            jm = j < nb_e
            tl.store(bexp_ptr + start_e + j, tl.zeros((BLOCK_B,), dtype=tl.int32) + e, mask=jm)
            tl.store(brows_ptr + start_e + j, tl.minimum(count_e - j * BM, BM), mask=jm)
        if e == 0:
            for b0 in range(0, NB, BLOCK_B):
                b = b0 + tl.arange(0, BLOCK_B)
                bm = (b >= total) & (b < NB)
                tl.store(bexp_ptr + b, tl.full((BLOCK_B,), -1, dtype=tl.int32), mask=bm)
                tl.store(brows_ptr + b, tl.zeros((BLOCK_B,), dtype=tl.int32), mask=bm)

    @triton.jit
    def _gate_up_act(
        x_ptr,  # [N, H]
        w_ptr,  # [E, 2I, H] gate rows, then up rows
        act_ptr,  # [NB*BM, I] out, model dtype, padded expert-sorted rows
        sorted_ptr,
        bexp_ptr,
        brows_ptr,
        H,
        INTER,
        stride_x,
        stride_we,
        stride_wr,
        stride_a,
        K: tl.constexpr,  # top-k
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        EVEN_K: tl.constexpr,  # H % BK == 0
        EVEN_N: tl.constexpr,  # INTER % BN == 0
        IEEE: tl.constexpr,  # fp32 operands: IEEE fp32 dots, not TF32
        UPCAST: tl.constexpr,  # the interpreter with 16-bit operands (see _mma)
        RND: tl.constexpr,
        PRECISE: tl.constexpr,
    ):
        b = tl.program_id(0)
        nt = tl.program_id(1)
        e = tl.load(bexp_ptr + b)
        if e < 0:
            return
        nrows = tl.load(brows_ptr + b)
        m = tl.arange(0, BM)
        # padding rows read token 0 (finite values, never stored past the down GEMM)
        pair = tl.load(sorted_ptr + b * BM + m, mask=m < nrows, other=0)
        tok = (pair // K).to(tl.int64)
        n = nt * BN + tl.arange(0, BN)
        nm = n < INTER
        kk = tl.arange(0, BK)
        x_ptrs = x_ptr + tok[:, None] * stride_x + kk[None, :]  # [BM, BK]
        g_ptrs = w_ptr + e.to(tl.int64) * stride_we + n[None, :].to(tl.int64) * stride_wr + kk[:, None]
        u_ptrs = g_ptrs + INTER * stride_wr  # [BK, BN]
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, H, BK):
            if EVEN_K:
                xa = tl.load(x_ptrs)
                if EVEN_N:
                    wg = tl.load(g_ptrs)
                    wu = tl.load(u_ptrs)
                else:
                    wg = tl.load(g_ptrs, mask=nm[None, :], other=0.0)
                    wu = tl.load(u_ptrs, mask=nm[None, :], other=0.0)
            else:
                km = (k0 + kk) < H
                xa = tl.load(x_ptrs, mask=km[None, :], other=0.0)
                wg = tl.load(g_ptrs, mask=km[:, None] & nm[None, :], other=0.0)
                wu = tl.load(u_ptrs, mask=km[:, None] & nm[None, :], other=0.0)
            acc_g = _mma(xa, wg, acc_g, IEEE, UPCAST)
            acc_u = _mma(xa, wu, acc_u, IEEE, UPCAST)
            x_ptrs += BK
            g_ptrs += BK
            u_ptrs += BK
        g = round_to(acc_g, RND)  # grouped_mm's output dtype
        u = round_to(acc_u, RND)
        s = round_to(tl.div_rn(g, 1.0 + exp_f32(-g, PRECISE)), RND)  # F.silu in the model dtype
        a = round_to(s * u, RND)
        a_ptrs = act_ptr + (b * BM + m)[:, None].to(tl.int64) * stride_a + n[None, :]
        tl.store(a_ptrs, a.to(act_ptr.dtype.element_ty), mask=nm[None, :])

    @triton.jit
    def _down(
        act_ptr,  # [NB*BM, I]
        w_ptr,  # [E, H, I]
        tw_ptr,  # [P] routing weights
        y_ptr,  # [P, H] out, model dtype: row = pair
        sorted_ptr,
        bexp_ptr,
        brows_ptr,
        H,
        INTER,
        stride_a,
        stride_we,
        stride_wr,
        stride_y,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        EVEN_K: tl.constexpr,  # INTER % BK == 0
        EVEN_N: tl.constexpr,  # H % BN == 0
        IEEE: tl.constexpr,
        UPCAST: tl.constexpr,
        RND: tl.constexpr,
    ):
        b = tl.program_id(0)
        nt = tl.program_id(1)
        e = tl.load(bexp_ptr + b)
        if e < 0:
            return
        nrows = tl.load(brows_ptr + b)
        m = tl.arange(0, BM)
        mm = m < nrows
        pair = tl.load(sorted_ptr + b * BM + m, mask=mm, other=0)
        n = nt * BN + tl.arange(0, BN)
        nm = n < H
        kk = tl.arange(0, BK)
        a_ptrs = act_ptr + (b * BM + m)[:, None].to(tl.int64) * stride_a + kk[None, :]  # [BM, BK]
        w_ptrs = w_ptr + e.to(tl.int64) * stride_we + n[None, :].to(tl.int64) * stride_wr + kk[:, None]
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, INTER, BK):
            if EVEN_K:
                aa = tl.load(a_ptrs)
                if EVEN_N:
                    w = tl.load(w_ptrs)
                else:
                    w = tl.load(w_ptrs, mask=nm[None, :], other=0.0)
            else:
                km = (k0 + kk) < INTER
                aa = tl.load(a_ptrs, mask=km[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=km[:, None] & nm[None, :], other=0.0)
            acc = _mma(aa, w, acc, IEEE, UPCAST)
            a_ptrs += BK
            w_ptrs += BK
        tw = round_to(tl.load(tw_ptr + pair, mask=mm, other=0.0).to(tl.float32), RND)  # .to(y.dtype)
        y = round_to(round_to(acc, RND) * tw[:, None], RND)
        y_ptrs = y_ptr + pair[:, None].to(tl.int64) * stride_y + n[None, :]
        tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=mm[:, None] & nm[None, :])

    @triton.jit
    def _combine(
        y_ptr,  # [N*K, H]
        out_ptr,  # [N, H]
        H,
        stride_y,
        stride_o,
        K: tl.constexpr,
        BH: tl.constexpr,
        RND: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BH + tl.arange(0, BH)
        hm = h < H
        acc = tl.zeros((BH,), dtype=tl.float32)
        for j in tl.static_range(K):  # slot order: a fixed fp32 sum
            acc += tl.load(y_ptr + (t * K + j) * stride_y + h, mask=hm, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * stride_o + h, round_to(acc, RND).to(out_ptr.dtype.element_ty), mask=hm)


def num_row_blocks(n_pairs: int, n_experts: int, block_m: int) -> int:
    """The static bound on row blocks: each non-empty expert pads fewer than block_m rows."""
    return -(-n_pairs // block_m) + min(n_pairs, n_experts)


def moe_prefill_align(
    topk_ids: torch.Tensor,  # [N, k]
    n_experts: int,
    block_m: int = 16,
    *,
    block_p: int = 1024,  # ids per histogram step; >= 32 * num_warps
    num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_pairs [NB*block_m] int32, block_expert [NB] int32, block_rows [NB] int32) on the device.

    Row block b of the padded expert-sorted layout holds `block_rows[b]` pairs (pair = token*k + slot) of
    expert `block_expert[b]` in rows b*block_m .. b*block_m + block_rows[b] - 1 of `sorted_pairs`, in
    pair order; the rest of a block's rows are padding (unwritten). Unused blocks have expert -1.
    """
    require_triton()
    ids = topk_ids.reshape(-1)
    ids = ids if ids.is_contiguous() else ids.contiguous()
    p = ids.numel()
    nb = num_row_blocks(p, n_experts, block_m)
    dev = topk_ids.device
    sorted_pairs = torch.empty(nb * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(nb, dtype=torch.int32, device=dev)
    block_rows = torch.empty(nb, dtype=torch.int32, device=dev)
    if p == 0:
        return sorted_pairs, block_expert, block_rows
    _align[(n_experts,)](
        ids,
        sorted_pairs,
        block_expert,
        block_rows,
        p,
        nb,
        BM=block_m,
        BLOCK_P=block_p,  # fixed, not sized from P: one compiled variant for every N
        BLOCK_E=max(next_pow2(n_experts), 16),
        BLOCK_B=64,
        num_warps=num_warps,
    )
    return sorted_pairs, block_expert, block_rows


def moe_prefill_triton(
    hidden: torch.Tensor,  # [N, H]
    topk_ids: torch.Tensor,  # [N, k]
    topk_weights: torch.Tensor,  # [N, k]
    gate_up_proj: torch.Tensor,  # [E, 2I, H]
    down_proj: torch.Tensor,  # [E, H, I]
    *,
    block_m: int = DEFAULT_CONFIG["block_m"],
    block_n: int = DEFAULT_CONFIG["block_n"],
    block_k: int = DEFAULT_CONFIG["block_k"],
    block_n_down: int = DEFAULT_CONFIG["block_n_down"],
    block_k_down: int = DEFAULT_CONFIG["block_k_down"],
    num_warps: int = DEFAULT_CONFIG["num_warps"],
    num_stages: int = DEFAULT_CONFIG["num_stages"],
    block_h_combine: int = 1024,
) -> torch.Tensor:  # [N, H]
    """The four-launch expert computation (module doc); output in hidden's dtype.

    Block sizes must be powers of two and at least 16 (tl.dot's minimum); shapes need not be multiples
    of them. Hidden and both weight tensors must share a dtype (float32, bfloat16 or float16).
    """
    require_triton()
    n, k = topk_ids.shape
    e_count, two_i, h = gate_up_proj.shape
    inter = two_i // 2
    if (
        hidden.shape != (n, h)
        or down_proj.shape != (e_count, h, inter)
        or topk_weights.shape != (n, k)
        or two_i != 2 * inter
    ):
        raise ValueError(
            f"shape mismatch: hidden {tuple(hidden.shape)}, topk_ids {tuple(topk_ids.shape)}, "
            f"topk_weights {tuple(topk_weights.shape)}, gate_up_proj {tuple(gate_up_proj.shape)}, "
            f"down_proj {tuple(down_proj.shape)}"
        )
    if not hidden.dtype == gate_up_proj.dtype == down_proj.dtype:
        raise ValueError(
            f"hidden and weights must share a dtype: {hidden.dtype}, {gate_up_proj.dtype}, {down_proj.dtype}"
        )
    for name, v in dict(block_m=block_m, block_n=block_n, block_k=block_k).items():
        if v < 16 or v & (v - 1):
            raise ValueError(f"{name} must be a power of two >= 16, not {v}")
    code = rnd(hidden.dtype)
    dev = hidden.device
    out = torch.empty(n, h, dtype=hidden.dtype, device=dev)  # [N, H]
    if n == 0:
        return out
    # The kernels index the last dim with unit stride; experts and rows may be strided.
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    gate_up_proj = gate_up_proj if gate_up_proj.stride(-1) == 1 else gate_up_proj.contiguous()
    down_proj = down_proj if down_proj.stride(-1) == 1 else down_proj.contiguous()
    tw = topk_weights.reshape(-1)
    tw = tw if tw.is_contiguous() else tw.contiguous()  # [P]
    p = n * k
    sorted_pairs, block_expert, block_rows = moe_prefill_align(topk_ids, e_count, block_m)
    nb = block_expert.numel()
    act = torch.empty(nb * block_m, inter, dtype=hidden.dtype, device=dev)  # [NB*BM, I]
    y = torch.empty(p, h, dtype=hidden.dtype, device=dev)  # [P, H]
    ieee = hidden.dtype == torch.float32
    upcast = not ieee and not precise()  # precise() is False exactly in the interpreter
    _gate_up_act[(nb, -(-inter // block_n))](
        hidden,
        gate_up_proj,
        act,
        sorted_pairs,
        block_expert,
        block_rows,
        h,
        inter,
        hidden.stride(0),
        gate_up_proj.stride(0),
        gate_up_proj.stride(1),
        act.stride(0),
        K=k,
        BM=block_m,
        BN=block_n,
        BK=block_k,
        EVEN_K=h % block_k == 0,
        EVEN_N=inter % block_n == 0,
        IEEE=ieee,
        UPCAST=upcast,
        RND=code,
        PRECISE=precise(),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    _down[(nb, -(-h // block_n_down))](
        act,
        down_proj,
        tw,
        y,
        sorted_pairs,
        block_expert,
        block_rows,
        h,
        inter,
        act.stride(0),
        down_proj.stride(0),
        down_proj.stride(1),
        y.stride(0),
        BM=block_m,
        BN=block_n_down,
        BK=block_k_down,
        EVEN_K=inter % block_k_down == 0,
        EVEN_N=h % block_n_down == 0,
        IEEE=ieee,
        UPCAST=upcast,
        RND=code,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    bh = min(block_h_combine, next_pow2(h))
    _combine[(n, -(-h // bh))](y, out, h, y.stride(0), out.stride(0), K=k, BH=bh, RND=code, num_warps=4)
    return out
