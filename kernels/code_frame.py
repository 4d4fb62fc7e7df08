"""The code predictor's frame in few launches, for `CodePredictor.frame_fn`.

Why: a frame is 15 sequential steps through a 5-layer dense decoder, and at batch 1 every step is a
chain of GEMVs over ~10 MB of weights. With the other fused kernels a step still made ~85 launches (norms,
the rotary tables and mask rebuilt per step, transposes, residual adds, SiLU, the code embedding), so a
frame was ~1,270 launches and 5.3 ms on an H200 against a 0.58 ms bandwidth floor (docs/performance.md).
Here a step is 5 launches per layer, plus the head and the sampler:

  1. `_linear` NORM            input RMSNorm fused into the packed q/k/v GEMV
  2. `_attention`              q/k RMSNorm, RoPE, k/v written to the cache, attention over rows 0..position
  3. `_linear` RESIDUAL        o_proj GEMV + the residual add
  4. `_linear` NORM, SWIGLU    post-attention RMSNorm + the packed gate/up GEMV + silu(gate) * up
  5. `_linear` RESIDUAL        down_proj GEMV + the residual add
  head: `_linear` NORM         the final norm + this group's lm_head; then the caller's `sample`

The next code's embedding is never materialised: the next step's kernels 1 and 3 read its row from the
embedding table (GATHER). The RoPE table holds the predictor's 16 positions, made once.

Numbers: every intermediate is rounded where the plain path rounds (`_triton.round_to`), so in bf16 the
results equal the plain path's up to the order of the GEMV sums (cuBLAS picks its own) and of the
softmax: an ulp here and there, as between cuBLAS kernels; in fp32 to ~1e-6. Greedy codes equal the plain
path's unless two logits are within such an ulp.

    from omni_rt.kernels.code_frame import install_code_frame
    install_code_frame(model)   # sets frame_fn on every CodePredictor; None restores the plain frame
"""

from __future__ import annotations

import contextlib

import torch
from omni_rt.kernels import sample as sample_kernel
from omni_rt.kernels._common import FLOATS, mark, next_pow2, precise, require_triton, rnd
from omni_rt.kernels.packed import pack_linears

try:  # the kernels need Triton; the plain frame does not
    import triton
    import triton.language as tl
    from omni_rt.kernels._triton import (
        exp_f32,
        gdc_launch_dependents,
        gdc_wait,
        pdl_runs,
        round_to,
        rsqrt_f32,
    )
except ImportError:  # pragma: no cover - depends on the machine
    triton = None

EPI_NONE, EPI_RESIDUAL, EPI_SWIGLU = 0, 1, 2

if triton is not None:

    @triton.jit
    def _mac(acc, x, w, DOT: tl.constexpr, F32_DOT: tl.constexpr):
        """acc [BM, BN] += x [BM, BK] . w [BN, BK]^T (x holds values exact in w's dtype)."""
        if DOT:
            if F32_DOT:
                acc += tl.dot(x, tl.trans(w.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(x.to(w.dtype), tl.trans(w))
        else:  # a few rows: broadcast and reduce (tl.dot's smallest tile is 16 rows)
            acc += tl.sum(x[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        return acc

    @triton.jit
    def _linear(
        x_ptr,  # [rows, K] (X_GATHER: an embedding table, rows picked by idx)
        idx_ptr,  # [M] int64 (X_GATHER / R_GATHER)
        w_ptr,  # [N (+ up_off), K] weight, unit stride along K
        g_ptr,  # [K] RMSNorm weight (NORM)
        r_ptr,  # [rows, N] residual (EPI_RESIDUAL; R_GATHER: the table x_ptr's rows)
        y_ptr,  # [M, N] out
        M,
        N,
        K,
        stride_x,
        stride_w,
        stride_r,
        stride_y,
        up_off,  # EPI_SWIGLU: the up rows start here in w
        eps,
        inv_k,  # 1/K in fp32: PyTorch's CUDA mean multiplies the sum by this factor
        NORM: tl.constexpr,
        X_GATHER: tl.constexpr,
        R_GATHER: tl.constexpr,
        EPI: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        DOT: tl.constexpr,
        F32_DOT: tl.constexpr,
        RND: tl.constexpr,  # the activation dtype: where the plain path rounds
        PRECISE: tl.constexpr,
        SINGLE: tl.constexpr,  # K <= BK: one tile
        PDL: tl.constexpr,  # launched as a programmatic dependent launch (`_triton.pdl_runs`)
    ):
        if PDL:  # let the next kernel's programs start and fetch their weights while this one runs
            gdc_launch_dependents()
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        rm = pid_m * BM + tl.arange(0, BM)
        mm = rm < M
        rm64 = rm.to(tl.int64)
        rn = pid_n * BN + tl.arange(0, BN)
        nm = rn < N
        rk = tl.arange(0, BK)
        w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_w  # [BN, 1]
        acc = tl.zeros([BM, BN], tl.float32)
        acc_up = tl.zeros([BM, BN], tl.float32)
        if SINGLE:  # K fits one tile: the weights (never written) are fetched before the inputs are ready
            wmask = nm[:, None] & (rk < K)[None, :]
            w0 = tl.load(w_rows + rk[None, :], mask=wmask, other=0.0)
            if EPI == 2:
                u0 = tl.load(w_rows + up_off * stride_w + rk[None, :], mask=wmask, other=0.0)
            if NORM:
                g0 = tl.load(g_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)
        if PDL:  # everything below reads what earlier kernels wrote
            gdc_wait()
        if X_GATHER or R_GATHER:
            gathered = tl.load(idx_ptr + rm, mask=mm, other=0).to(tl.int64)
        else:
            gathered = rm64
        xrow = gathered if X_GATHER else rm64
        x_rows = x_ptr + xrow[:, None] * stride_x  # [BM, 1]
        if SINGLE:
            xv = tl.load(x_rows + rk[None, :], mask=mm[:, None] & (rk < K)[None, :], other=0.0).to(tl.float32)
            if NORM:  # RMSNorm as layers.RMSNorm: x * rstd rounded, then weight * that rounded
                rstd = rsqrt_f32(tl.sum(xv * xv, axis=1) * inv_k + eps, PRECISE)
                xv = round_to(g0[None, :] * round_to(xv * rstd[:, None], RND), RND)
            acc = _mac(acc, xv, w0, DOT, F32_DOT)
            if EPI == 2:
                acc_up = _mac(acc_up, xv, u0, DOT, F32_DOT)
        else:
            if NORM:
                ss = tl.zeros([BM], tl.float32)
                for k0 in range(0, K, BK):
                    km = (k0 + rk) < K
                    xv = tl.load(x_rows + k0 + rk[None, :], mask=mm[:, None] & km[None, :], other=0.0)
                    xv = xv.to(tl.float32)
                    ss += tl.sum(xv * xv, axis=1)
                rstd = rsqrt_f32(ss * inv_k + eps, PRECISE)
            for k0 in range(0, K, BK):
                kk = k0 + rk
                km = kk < K
                xv = tl.load(x_rows + kk[None, :], mask=mm[:, None] & km[None, :], other=0.0).to(tl.float32)
                if NORM:
                    gv = tl.load(g_ptr + kk, mask=km, other=0.0).to(tl.float32)
                    xv = round_to(gv[None, :] * round_to(xv * rstd[:, None], RND), RND)
                wmask = nm[:, None] & km[None, :]
                wv = tl.load(w_rows + kk[None, :], mask=wmask, other=0.0)
                acc = _mac(acc, xv, wv, DOT, F32_DOT)
                if EPI == 2:
                    uv = tl.load(w_rows + up_off * stride_w + kk[None, :], mask=wmask, other=0.0)
                    acc_up = _mac(acc_up, xv, uv, DOT, F32_DOT)
        y = round_to(acc, RND)  # the GEMM's output, in the activation dtype
        out_mask = mm[:, None] & nm[None, :]
        if EPI == 1:
            rrow = gathered if R_GATHER else rm64
            rv = tl.load(r_ptr + rrow[:, None] * stride_r + rn[None, :], mask=out_mask, other=0.0)
            y = round_to(rv.to(tl.float32) + y, RND)
        if EPI == 2:  # F.silu(gate) * up, each op rounded as PyTorch's bf16 kernels do
            up = round_to(acc_up, RND)
            s = round_to(tl.div_rn(y, 1.0 + exp_f32(-y, PRECISE)), RND)
            y = round_to(s * up, RND)
        tl.store(y_ptr + rm64[:, None] * stride_y + rn[None, :], y.to(y_ptr.dtype.element_ty), mask=out_mask)

    @triton.jit
    def _norm_rope(lo, hi, w_ptr, c_lo, c_hi, s_lo, s_hi, half, eps, inv_d, HAS_NORM: tl.constexpr,
                   RND: tl.constexpr, PRECISE: tl.constexpr, D: tl.constexpr):  # fmt: skip
        """One head's halves (fp32, exact in the activation dtype) -> RMSNorm'd and rotated halves."""
        if HAS_NORM:
            var = (tl.sum(lo * lo, axis=0) + tl.sum(hi * hi, axis=0)) * inv_d
            r = rsqrt_f32(var + eps, PRECISE)
            w_lo = tl.load(w_ptr + half).to(tl.float32)
            w_hi = tl.load(w_ptr + D // 2 + half).to(tl.float32)
            lo = round_to(w_lo * round_to(lo * r, RND), RND)
            hi = round_to(w_hi * round_to(hi * r, RND), RND)
        # x * cos + rotate_half(x) * sin, rotate_half(x) = [-hi, lo]
        out_lo = round_to(round_to(lo * c_lo, RND) + round_to(-hi * s_lo, RND), RND)
        out_hi = round_to(round_to(hi * c_hi, RND) + round_to(lo * s_hi, RND), RND)
        return out_lo, out_hi

    @triton.jit
    def _new_row(row, pos, cos_ptr, sin_ptr, kw_ptr, half, g, eps, inv_d, HQ: tl.constexpr, KV: tl.constexpr,
                 D: tl.constexpr, HAS_NORM: tl.constexpr, RND: tl.constexpr, RND_C: tl.constexpr,
                 PRECISE: tl.constexpr):  # fmt: skip
        """A new position's RoPE rows and kv head g's k (normed, rotated) and v, each rounded to the cache's
        dtype as the plain path reads them back: (cos lo, cos hi, sin lo, sin hi, k lo, k hi, v lo, v hi)."""
        c_lo = tl.load(cos_ptr + pos * D + half).to(tl.float32)
        c_hi = tl.load(cos_ptr + pos * D + D // 2 + half).to(tl.float32)
        s_lo = tl.load(sin_ptr + pos * D + half).to(tl.float32)
        s_hi = tl.load(sin_ptr + pos * D + D // 2 + half).to(tl.float32)
        k_lo = tl.load(row + (HQ + g) * D + half).to(tl.float32)
        k_hi = tl.load(row + (HQ + g) * D + D // 2 + half).to(tl.float32)
        k_lo, k_hi = _norm_rope(k_lo, k_hi, kw_ptr, c_lo, c_hi, s_lo, s_hi, half, eps, inv_d, HAS_NORM, RND,
                                PRECISE, D)  # fmt: skip
        v_lo = tl.load(row + (HQ + KV + g) * D + half).to(tl.float32)
        v_hi = tl.load(row + (HQ + KV + g) * D + D // 2 + half).to(tl.float32)
        return (c_lo, c_hi, s_lo, s_hi, round_to(k_lo, RND_C), round_to(k_hi, RND_C), round_to(v_lo, RND_C),
                round_to(v_hi, RND_C))  # fmt: skip

    @triton.jit
    def _attention(
        qkv_ptr,  # [B*T, (HQ + 2 KV) * D] the packed projection's rows (b * T + t)
        qw_ptr,  # [D] q_norm weight
        kw_ptr,  # [D] k_norm weight
        cos_ptr,  # [P, D] the positions' table
        sin_ptr,
        kc_ptr,  # [S, KV, L, D] this layer's k cache; batch row b uses slot b
        vc_ptr,
        o_ptr,  # [B*T, HQ*D] out
        p0,  # the first new position: rows [0, p0) are in the cache already
        eps,
        inv_d,
        scale,
        stride_qkv,
        stride_o,
        stride_cs,
        stride_ch,
        stride_cl,
        T: tl.constexpr,  # new positions, 1 or 2
        HQ: tl.constexpr,
        KV: tl.constexpr,
        REP: tl.constexpr,
        D: tl.constexpr,
        BL: tl.constexpr,  # a power of two >= p0 (the cached rows read)
        HAS_NORM: tl.constexpr,
        RND: tl.constexpr,
        RND_C: tl.constexpr,
        PRECISE: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """One program per (batch row, query head). The new rows of k and v stay in registers: the
        cached rows are read from memory, the new ones are not read back (no barrier, one round of
        loads); the first query head of each kv group writes them to the cache for later steps."""
        if PDL:
            gdc_launch_dependents()
            gdc_wait()  # the cache and the projections are earlier kernels' writes
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        g = h // REP
        half = tl.arange(0, D // 2)
        kc = kc_ptr + b * stride_cs + g * stride_ch
        vc = vc_ptr + b * stride_cs + g * stride_ch
        rows = tl.arange(0, BL)
        cached = rows < p0
        cm = cached[:, None]
        k_lo_c = tl.load(kc + rows[:, None] * stride_cl + half[None, :], mask=cm, other=0.0).to(tl.float32)
        k_hi_c = tl.load(kc + rows[:, None] * stride_cl + D // 2 + half[None, :], mask=cm, other=0.0)
        v_lo_c = tl.load(vc + rows[:, None] * stride_cl + half[None, :], mask=cm, other=0.0).to(tl.float32)
        v_hi_c = tl.load(vc + rows[:, None] * stride_cl + D // 2 + half[None, :], mask=cm, other=0.0)
        k_hi_c = k_hi_c.to(tl.float32)
        v_hi_c = v_hi_c.to(tl.float32)
        # the new rows: k normed and rotated, both rounded to the cache's dtype as the plain path reads them
        row0 = qkv_ptr + (b * T) * stride_qkv
        c_lo0, c_hi0, s_lo0, s_hi0, k_lo0, k_hi0, v_lo0, v_hi0 = _new_row(
            row0, p0, cos_ptr, sin_ptr, kw_ptr, half, g, eps, inv_d, HQ, KV, D, HAS_NORM, RND, RND_C, PRECISE
        )
        if T == 2:
            c_lo1, c_hi1, s_lo1, s_hi1, k_lo1, k_hi1, v_lo1, v_hi1 = _new_row(
                row0 + stride_qkv, p0 + 1, cos_ptr, sin_ptr, kw_ptr, half, g, eps, inv_d, HQ, KV, D, HAS_NORM,
                RND, RND_C, PRECISE,
            )  # fmt: skip
        if h % REP == 0:  # one writer per kv head
            dt = kc_ptr.dtype.element_ty
            tl.store(kc + p0 * stride_cl + half, k_lo0.to(dt))
            tl.store(kc + p0 * stride_cl + D // 2 + half, k_hi0.to(dt))
            tl.store(vc + p0 * stride_cl + half, v_lo0.to(dt))
            tl.store(vc + p0 * stride_cl + D // 2 + half, v_hi0.to(dt))
            if T == 2:
                tl.store(kc + (p0 + 1) * stride_cl + half, k_lo1.to(dt))
                tl.store(kc + (p0 + 1) * stride_cl + D // 2 + half, k_hi1.to(dt))
                tl.store(vc + (p0 + 1) * stride_cl + half, v_lo1.to(dt))
                tl.store(vc + (p0 + 1) * stride_cl + D // 2 + half, v_hi1.to(dt))
        for t in tl.static_range(T):  # query t sees the cached rows, new row 0, and new row 1 if t == 1
            row = qkv_ptr + (b * T + t) * stride_qkv
            if t == 0:
                c_lo, c_hi, s_lo, s_hi = c_lo0, c_hi0, s_lo0, s_hi0
            else:
                c_lo, c_hi, s_lo, s_hi = c_lo1, c_hi1, s_lo1, s_hi1
            q_lo = tl.load(row + h * D + half).to(tl.float32)
            q_hi = tl.load(row + h * D + D // 2 + half).to(tl.float32)
            q_lo, q_hi = _norm_rope(q_lo, q_hi, qw_ptr, c_lo, c_hi, s_lo, s_hi, half, eps, inv_d, HAS_NORM,
                                    RND, PRECISE, D)  # fmt: skip
            score = tl.sum(k_lo_c * q_lo[None, :], axis=1) + tl.sum(k_hi_c * q_hi[None, :], axis=1)
            score = tl.where(cached, score * scale, float("-inf"))
            s0 = (tl.sum(k_lo0 * q_lo, axis=0) + tl.sum(k_hi0 * q_hi, axis=0)) * scale
            m = tl.maximum(tl.max(score, axis=0), s0)
            if t == 1:
                s1 = (tl.sum(k_lo1 * q_lo, axis=0) + tl.sum(k_hi1 * q_hi, axis=0)) * scale
                m = tl.maximum(m, s1)
            p = exp_f32(score - m, PRECISE)
            e0 = exp_f32(s0 - m, PRECISE)
            # as flash attention: P rounded to the value dtype for P.V, the sum of P kept in fp32
            l_sum = tl.sum(p, axis=0) + e0
            p_v = round_to(p, RND_C)
            e0_v = round_to(e0, RND_C)
            o_lo = tl.sum(p_v[:, None] * v_lo_c, axis=0) + e0_v * v_lo0
            o_hi = tl.sum(p_v[:, None] * v_hi_c, axis=0) + e0_v * v_hi0
            if t == 1:
                e1 = exp_f32(s1 - m, PRECISE)
                l_sum += e1
                e1_v = round_to(e1, RND_C)
                o_lo += e1_v * v_lo1
                o_hi += e1_v * v_hi1
            out = o_ptr + (b * T + t) * stride_o + h * D
            tl.store(out + half, round_to(tl.div_rn(o_lo, l_sum), RND).to(o_ptr.dtype.element_ty))
            tl.store(out + D // 2 + half, round_to(tl.div_rn(o_hi, l_sum), RND).to(o_ptr.dtype.element_ty))


# Block shapes. A GEMV at batch 1 reads each weight once, so what matters is enough programs in flight
# to pull the bandwidth (N / BN of them) and few K iterations (each one a dependent round of loads: BK
# 256 -> 512 took the frame from 4.85 to 3.28 ms on an H200); rows beyond SMALL_M take
# tl.dot's 16-row tiles. Measured on an H200 by scripts/gpu_code_frame.py (docs/performance.md).
SMALL_M = 4
GEMV_BLOCKS = {"BM": 4, "BN": 4, "BK": 2048, "num_warps": 4}
DOT_BLOCKS = {"BM": 16, "BN": 32, "BK": 256, "num_warps": 4}
# GEMV_BLOCKS' entries overridden for one linear of the step ("qkv", "o_proj", "gate_up", "down",
# "head"): their shapes differ (N 1024 to 6144, K 1024 to 3072), and the batch-1 sweep above tried one
# shape for all five. scripts/gpu_code_frame.py's per-linear sweep on an H100 (2026-12-05, with
# programmatic launches; frame 1.956 ms greedy with none of these): down_proj's K of 3072 in one tile
# 1.854 (its weights then load before the programmatic wait, as the one-tile GEMVs' do), o_proj in
# narrower programs 1.905, q/k/v in wider ones 1.929; the three together with the head's (noise) 1.793.
GEMV_KIND_BLOCKS: dict[str, dict[str, int]] = {
    "qkv": {"BN": 8, "num_warps": 4},
    "o_proj": {"BN": 2, "num_warps": 2},
    "down": {"BK": 4096, "num_warps": 4},
}
# Programmatic dependent launches (`_triton.pdl_runs`) on the few-rows path only: on the tl.dot path
# they cost time (batch 8 went 3.09 -> 3.38 ms with them on an H200).


class CodeFrame:
    """A `CodePredictor`'s frame in few launches: its weights packed once, the RoPE table, the launches.

    Called as `CodePredictor.frame_fn(predictor, talker_hidden, code0_embed, sample)`; same contract as
    `CodePredictor.predict` (static shapes, no host sync: a whole frame can be captured in one graph).
    """

    def __init__(self, cp, programmatic_launch: bool = False) -> None:
        require_triton()
        cfg = cp.cfg
        head = cp.lm_head[0].weight
        if head.dtype not in FLOATS:
            raise ValueError(f"the fused code frame supports float32, bfloat16 and float16, not {head.dtype}")
        if cfg.head_dim % 2 or cfg.head_dim & (cfg.head_dim - 1):
            raise ValueError(f"the fused code frame needs a power-of-two head_dim, got {cfg.head_dim}")
        self.cfg = cfg
        self.layers = []
        for layer in cp.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(
                (
                    layer.input_layernorm.weight,
                    pack_linears(attn, ("q_proj", "k_proj", "v_proj")),
                    attn.q_norm.weight if attn.use_qk_norm else None,
                    attn.k_norm.weight if attn.use_qk_norm else None,
                    attn.o_proj.weight,
                    layer.post_attention_layernorm.weight,
                    pack_linears(mlp, ("gate_proj", "up_proj")),
                    mlp.down_proj.weight,
                )
            )
        self.final_norm = cp.model.norm.weight
        self.heads = [h.weight for h in cp.lm_head]
        self.embeds = [e.weight for e in cp.model.codec_embedding]
        positions = torch.arange(cp.num_code_groups, device=head.device)[None]
        cos, sin = cp.rotary(positions, head.dtype)  # [1, P, D], as the plain frame computes them
        self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()
        self.rnd = rnd(head.dtype)
        self.eps = cfg.rms_norm_eps
        self.pdl_runs = pdl_runs(head.device)
        self.pdl = programmatic_launch and self.pdl_runs
        self.launch = {"launch_pdl": True} if self.pdl else {}

    programmatic_rows = SMALL_M  # the largest batch whose frames take programmatic launches (steps 1-14)

    @contextlib.contextmanager
    def programmatic(self):
        """Within: the few-rows kernels as programmatic dependent launches, where the card runs them (yields
        whether it does). For capturing a second set of frame graphs that the Talker's runner replays while
        the Thinker has no work on the GPU (`EngineSettings.programmatic_launch` 'idle')."""
        saved = self.pdl, self.launch
        self.pdl = self.pdl_runs
        self.launch = {"launch_pdl": True} if self.pdl else {}
        try:
            yield self.pdl
        finally:
            self.pdl, self.launch = saved

    def _linear(self, kind, x, w, m, *, norm=None, idx=None, gather_x=False, residual=None, gather_r=False,
                swiglu=False, stride_x=None):  # fmt: skip
        k = w.shape[1]
        n = w.shape[0] // 2 if swiglu else w.shape[0]
        y = torch.empty(m, n, dtype=w.dtype, device=w.device)
        small = m <= SMALL_M
        if small:
            blocks = GEMV_BLOCKS | GEMV_KIND_BLOCKS.get(kind, {})
            bm = min(next_pow2(m), blocks["BM"])  # more rows: more programs, the weights from L2
            bn, bk, warps = blocks["BN"], blocks["BK"], blocks["num_warps"]
        else:
            bm, bn, bk, warps = (DOT_BLOCKS[key] for key in ("BM", "BN", "BK", "num_warps"))
        bk = min(bk, next_pow2(k))
        grid = (triton.cdiv(n, bn), triton.cdiv(m, bm))
        epi = EPI_SWIGLU if swiglu else EPI_RESIDUAL if residual is not None else EPI_NONE
        _linear[grid](
            x, idx if idx is not None else y, w, norm if norm is not None else w,
            residual if residual is not None else y, y,
            m, n, k, x.stride(0) if stride_x is None else stride_x, w.stride(0),
            residual.stride(0) if residual is not None else 0, y.stride(0), n if swiglu else 0,
            self.eps, 1.0 / k,
            NORM=norm is not None, X_GATHER=gather_x, R_GATHER=gather_r, EPI=epi,
            BM=bm, BN=bn, BK=bk, DOT=not small, F32_DOT=w.dtype == torch.float32 or not precise(),
            RND=self.rnd, PRECISE=precise(), SINGLE=k <= bk, PDL=self.pdl and small, num_warps=warps,
            **(self.launch if small else {}),
        )  # fmt: skip
        return y

    def _attention(self, qkv, q_w, k_w, cache, layer: int, b: int, t: int, p0: int) -> torch.Tensor:
        cfg = self.cfg
        hq, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        out = torch.empty(b * t, hq * d, dtype=qkv.dtype, device=qkv.device)
        kc, vc = cache.k[layer], cache.v[layer]  # [S, KV, L, D]
        pdl = (
            self.pdl and b * t <= SMALL_M
        )  # with more rows it cost time on an H200 (batch 8: 3.09 -> 3.38 ms)
        _attention[(b, hq)](
            qkv, q_w if q_w is not None else qkv, k_w if k_w is not None else qkv, self.cos, self.sin,
            kc, vc, out, p0, self.eps, 1.0 / d, d**-0.5,
            qkv.stride(0), out.stride(0), kc.stride(0), kc.stride(1), kc.stride(2),
            T=t, HQ=hq, KV=kv, REP=hq // kv, D=d, BL=max(next_pow2(p0), 2), HAS_NORM=q_w is not None,
            RND=self.rnd, RND_C=rnd(kc.dtype), PRECISE=precise(), PDL=pdl, num_warps=4,
            **(self.launch if pdl else {}),
        )  # fmt: skip
        return out

    def __call__(self, cp, talker_hidden: torch.Tensor, code0_embed: torch.Tensor, sample) -> torch.Tensor:
        b, width = talker_hidden.shape
        cache = cp._cache_for(b, talker_hidden)
        x = torch.stack((talker_hidden, code0_embed), dim=1).view(2 * b, width)  # rows b * 2 + t
        n = cp.num_code_groups - 1
        # a fused sampler's draw becomes a programmatic launch too, after the head's (which allows it)
        with sample_kernel.programmatic(self.pdl and b <= SMALL_M):
            codes = self._codes(x, b, cache, n, sample)
        return torch.stack(codes, dim=1)  # [B, 15]

    def _codes(self, x, b: int, cache, n: int, sample) -> list[torch.Tensor]:
        codes: list[torch.Tensor] = []
        idx = None  # set: the step's input rows are this code's rows of an embedding table
        for i in range(n):
            t, p0 = (2, 0) if i == 0 else (1, i + 1)  # step 0 is the 2-position prefill (see predict)
            m = b * t
            h = x
            for layer, (ln1, qkv_w, q_w, k_w, o_w, ln2, gate_up, down) in enumerate(self.layers):
                gather = idx is not None and layer == 0
                qkv = self._linear("qkv", h, qkv_w, m, norm=ln1, idx=idx, gather_x=gather)
                attn = self._attention(qkv, q_w, k_w, cache, layer, b, t, p0)
                mid = self._linear("o_proj", attn, o_w, m, idx=idx, residual=h, gather_r=gather)
                act = self._linear("gate_up", mid, gate_up, m, norm=ln2, swiglu=True)
                h = self._linear("down", act, down, m, residual=mid)
            # the last position of each row: rows b * t + t - 1, every t-th row from row t - 1
            logits = self._linear(
                "head", h[t - 1 :], self.heads[i], b, norm=self.final_norm, stride_x=t * h.stride(0)
            )
            code = sample(logits)  # [B]
            codes.append(code)
            if i + 1 < n:
                x, idx = self.embeds[i], code  # code i+1 enters step i+1 through codec_embedding[i]
        return codes


def install_code_frame(model: torch.nn.Module, programmatic_launch: bool = False) -> int:
    """Set `frame_fn` on every `CodePredictor` in `model` (dense, Triton-runnable); returns the count.
    programmatic_launch: the few-rows kernels as programmatic dependent launches where the card runs them."""
    from omni_rt.model.talker import CodePredictor

    require_triton()
    changed = 0
    for m in model.modules():
        if isinstance(m, CodePredictor):
            m.frame_fn = mark(CodeFrame(m, programmatic_launch), "code_frame")
            changed += 1
    return changed
