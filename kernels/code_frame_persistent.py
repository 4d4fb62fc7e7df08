"""The code predictor's whole frame in one persistent launch, for one or two rows (the first audio's frame).

Why: `code_frame.CodeFrame` makes a frame of 15 steps x 27 launches (5 per layer, the head, the sampler),
~405 launches. At batch 1 each one moves 4-12 MB of weights in 3-5 us on an H200, mostly its launch and
its ramp: the frame took 2.05 ms (2.33 sampled) against a 0.5 ms bandwidth floor (docs/performance.md).
Here one launch of one program per SM runs every phase of every step and waits at a grid-wide barrier
between phases (a counter in global memory: each program adds one and waits until all have), so a phase
boundary costs a barrier instead of a launch.

The phases are the same functions the per-step kernels run, so the numbers are theirs exactly (same tiles,
same rounding, same sums): `code_frame._linear_tile` over the GEMV tiles, `code_frame._attention_item` over
(row, query head), `sample._sample_row` over rows. Reads of what this launch wrote (activations, the
cache's new rows, the drawn codes) bypass L1 (".cg"): L1 is not coherent between SMs.

A barrier needs every program resident at once: the grid is one program per SM, which a kernel that
compiles at all always gets, and programs of other stages' kernels only delay ours (they end without
waiting on us). Triton's interpreter runs programs one after another, so there it runs one program
that walks every tile (the barriers pass at once).

Weights: per-layer tensors stacked ([layers, N, K]) so that a runtime layer index picks them, the 15 heads
and code embeddings likewise; about 290 MB of copies at the real shapes, made when first used.
"""

from __future__ import annotations

import os

import torch
from omni_rt.kernels._common import next_pow2, precise, require_triton, rnd

try:  # the kernels need Triton; the plain frame does not
    import triton
    import triton.language as tl
    from omni_rt.kernels.code_frame import GEMV_BLOCKS, _attention_item, _linear_tile
    from omni_rt.kernels.sample import SHORT_KEYS, _sample_row
except ImportError:  # pragma: no cover - depends on the machine
    triton = None

MAX_ROWS = 2  # frames of more rows take the per-step kernels (their phases are wider than the grid)
# Measured on an H200 by scripts/gpu_code_frame.py (docs/performance.md): output columns per tile, warps
# and programs per SM (all of them must be resident at once), and whether each phase asks L2 for the next
# phase's weights.
PERSISTENT_BLOCKS = {"BN": 4, "WIDE": 1, "num_warps": 4, "per_sm": 1}  # WIDE: BN's factor for q/k/v, gate/up
PREFETCH = True

if triton is not None:
    CG = tl.constexpr(".cg")  # loads of what this launch wrote: from L2, never a stale L1 line

    @triton.jit
    def _grid_sync(bar_ptr, epoch, nprog):
        """Every program reaches here before any goes on; what each wrote before is visible after (the
        barrier of cooperative groups: a CTA barrier, one release add per program, acquire polls)."""
        epoch += 1
        tl.debug_barrier()
        tl.atomic_add(bar_ptr, 1, sem="acq_rel", scope="gpu")
        target = epoch * nprog
        while tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu") < target:
            pass
        tl.debug_barrier()
        return epoch

    @triton.jit
    def _prefetch(w_ptr, n, pid, nprog, LINE: tl.constexpr, PREFETCH: tl.constexpr):
        """Ask L2 for this program's share of the n elements at w_ptr (one 128-byte line per thread and
        round), a phase ahead: the weights stream from memory while the phase before runs and waits."""
        if PREFETCH:
            offs = tl.arange(0, 128) * LINE
            for base in range(pid * 128 * LINE, n, nprog * 128 * LINE):
                p = w_ptr + tl.where(base + offs < n, base + offs, 0)
                tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [p],
                                          dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip

    @triton.jit
    def _next_weights(layer, L, i, qkv_w, s_wl_qkv, head_w, s_hg, n_qkv, n_head):
        """What the layer's phase 4 prefetches: the next layer's q/k/v, after the last layer head i."""
        if layer + 1 < L:
            w = qkv_w + (layer + 1) * s_wl_qkv
        else:
            w = head_w + i * s_hg
        n = tl.where(layer + 1 < L, n_qkv, n_head)
        return w, n

    @triton.jit
    def _gemv(pid, nprog, x_ptr, idx_ptr, w_ptr, g_ptr, r_ptr, y_ptr, M, N, K: tl.constexpr, stride_x, stride_w,
              stride_r, stride_y, up_off, eps, NORM: tl.constexpr, X_GATHER: tl.constexpr, R_GATHER: tl.constexpr,
              EPI: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, RND: tl.constexpr,
              PRECISE: tl.constexpr):  # fmt: skip
        """One GEMV phase: this program's column tiles of `code_frame._linear_tile`."""
        for tile in range(pid, tl.cdiv(N, BN), nprog):
            _linear_tile(tile, 0, x_ptr, idx_ptr, w_ptr, g_ptr, r_ptr, y_ptr, M, N, K, stride_x, stride_w,
                         stride_r, stride_y, up_off, eps, 1.0 / K, NORM, X_GATHER, R_GATHER, EPI, BM, BN, BK,
                         False, False, RND, PRECISE, K <= BK, False, CG)  # fmt: skip

    @triton.jit
    def _layer(
        pid, nprog, bar_ptr, epoch, layer, x_ptr, idx_ptr, h_ptr, qkv_ptr, att_ptr, mid_ptr, act_ptr, next_w, next_n,
        ln1_ptr, qkv_w, qn_ptr, kn_ptr, o_w, ln2_ptr, gu_w, down_w, cos_ptr, sin_ptr, kc_ptr, vc_ptr,
        B, p0, eps, inv_d, scale,
        s_h, s_qkv, s_att, s_mid, s_act, s_x, s_wl_qkv, s_wl_o, s_wl_gu, s_wl_down, s_cly, s_cs, s_ch, s_cp,
        H: tl.constexpr, NQKV: tl.constexpr, INTER: tl.constexpr,
        T: tl.constexpr, GATHER: tl.constexpr, HQ: tl.constexpr, KV: tl.constexpr, D: tl.constexpr,
        P: tl.constexpr, HAS_QK_NORM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK_H: tl.constexpr,
        BK_O: tl.constexpr, BK_I: tl.constexpr, RND: tl.constexpr, RND_C: tl.constexpr, PRECISE: tl.constexpr,
        LINE: tl.constexpr, PREFETCH: tl.constexpr, WIDE: tl.constexpr,
    ):  # fmt: skip
        """One decoder layer's five phases over the step's rows (b * T + t), each after a barrier. The
        layer's input is x (GATHER: the embedding rows of the codes at idx) or h; its output is h."""
        m = B * T
        lay = tl.cast(layer, tl.int64)
        x = x_ptr if GATHER else h_ptr
        sx = s_x if GATHER else s_h
        epoch = _grid_sync(bar_ptr, epoch, nprog)  # 1. input RMSNorm + packed q/k/v
        _prefetch(o_w + lay * s_wl_o, H * HQ * D, pid, nprog, LINE, PREFETCH)
        _gemv(pid, nprog, x, idx_ptr, qkv_w + lay * s_wl_qkv, ln1_ptr + lay * H, qkv_ptr, qkv_ptr, m, NQKV, H,
              sx, H, 0, s_qkv, 0, eps, True, GATHER, False, 0, BM, BN * WIDE, BK_H, RND, PRECISE)  # fmt: skip
        epoch = _grid_sync(bar_ptr, epoch, nprog)  # 2. q/k norm, RoPE, cache write, attention
        _prefetch(gu_w + lay * s_wl_gu, 2 * INTER * H, pid, nprog, LINE, PREFETCH)
        kc = kc_ptr + lay * s_cly
        vc = vc_ptr + lay * s_cly
        for item in range(pid, B * HQ, nprog):
            _attention_item(item // HQ, item % HQ, qkv_ptr, qn_ptr + lay * D, kn_ptr + lay * D, cos_ptr, sin_ptr,
                            kc, vc, att_ptr, p0, eps, inv_d, scale, s_qkv, s_att, s_cs, s_ch, s_cp, T, HQ, KV,
                            HQ // KV, D, P, HAS_QK_NORM, RND, RND_C, PRECISE, CG)  # fmt: skip
        epoch = _grid_sync(bar_ptr, epoch, nprog)  # 3. o_proj + residual
        _prefetch(down_w + lay * s_wl_down, H * INTER, pid, nprog, LINE, PREFETCH)
        _gemv(pid, nprog, att_ptr, idx_ptr, o_w + lay * s_wl_o, o_w, x, mid_ptr, m, H, HQ * D, s_att, HQ * D, sx,
              s_mid, 0, eps, False, False, GATHER, 1, BM, BN, BK_O, RND, PRECISE)  # fmt: skip
        epoch = _grid_sync(bar_ptr, epoch, nprog)  # 4. post-attention RMSNorm + gate/up + SwiGLU
        _prefetch(next_w, next_n, pid, nprog, LINE, PREFETCH)  # the next layer's q/k/v, or the head
        _gemv(pid, nprog, mid_ptr, idx_ptr, gu_w + lay * s_wl_gu, ln2_ptr + lay * H, mid_ptr, act_ptr, m, INTER, H,
              s_mid, H, 0, s_act, INTER, eps, True, False, False, 2, BM, BN * WIDE, BK_H, RND, PRECISE)  # fmt: skip
        epoch = _grid_sync(bar_ptr, epoch, nprog)  # 5. down_proj + residual
        _gemv(pid, nprog, act_ptr, idx_ptr, down_w + lay * s_wl_down, down_w, mid_ptr, h_ptr, m, H, INTER, s_act, INTER,
              s_mid, s_h, 0, eps, False, False, False, 1, BM, BN, BK_I, RND, PRECISE)  # fmt: skip
        return epoch

    @triton.jit
    def _head_and_draw(
        pid, nprog, bar_ptr, epoch, i, h_ptr, logit_ptr, codes_ptr, fnorm_ptr, head_w, next_w, next_n,
        slots_ptr, keys_ptr, temp_ptr, topk_ptr, topp_ptr, pen_ptr, dos_ptr, seed_ptr, seen_ptr, supp_ptr,
        B, eps, s_h, s_hg, s_logit, H: tl.constexpr, V: tl.constexpr,
        T: tl.constexpr, STAGE: tl.constexpr, HAS_SEEN: tl.constexpr, HAS_SUPP: tl.constexpr,
        BLOCK_V: tl.constexpr, KEY16: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
        RND: tl.constexpr, PRECISE: tl.constexpr, LINE: tl.constexpr, PREFETCH: tl.constexpr,
    ):  # fmt: skip
        """Code group i + 1: the final norm and head i on each row's last position, then each row's draw
        into codes[i]."""
        epoch = _grid_sync(bar_ptr, epoch, nprog)
        # the last position of each row: rows b * T + T - 1
        _gemv(pid, nprog, h_ptr + (T - 1) * s_h, codes_ptr, head_w + i * s_hg, fnorm_ptr, logit_ptr,
              logit_ptr, B, V, H, T * s_h, H, 0, s_logit, 0, eps, True, False, False, 0, BM, BN, BK, RND,
              PRECISE)  # fmt: skip
        epoch = _grid_sync(bar_ptr, epoch, nprog)
        _prefetch(next_w, next_n, pid, nprog, LINE, PREFETCH)  # the next step's first q/k/v
        for row in range(pid, B, nprog):
            _sample_row(row, logit_ptr, slots_ptr, keys_ptr, temp_ptr, topk_ptr, topp_ptr, pen_ptr, dos_ptr,
                        seed_ptr, seen_ptr, supp_ptr, codes_ptr + i * B, V, s_logit, i, STAGE, HAS_SEEN, HAS_SUPP,
                        BLOCK_V, PRECISE, KEY16, CG)  # fmt: skip
        return epoch

    @triton.jit
    def _frame(
        h_ptr, qkv_ptr, att_ptr, mid_ptr, act_ptr, logit_ptr, codes_ptr, bar_ptr,
        ln1_ptr, qkv_w, qn_ptr, kn_ptr, o_w, ln2_ptr, gu_w, down_w, fnorm_ptr, head_w, emb_w, cos_ptr, sin_ptr,
        kc_ptr, vc_ptr,
        slots_ptr, keys_ptr, temp_ptr, topk_ptr, topp_ptr, pen_ptr, dos_ptr, seed_ptr, seen_ptr, supp_ptr,
        B, eps, inv_d, scale,
        s_h, s_qkv, s_att, s_mid, s_act, s_logit, s_wl_qkv, s_wl_o, s_wl_gu, s_wl_down, s_hg, s_eg,
        s_cly, s_cs, s_ch, s_cp,
        H: tl.constexpr, NQKV: tl.constexpr, INTER: tl.constexpr, V: tl.constexpr, L: tl.constexpr,
        G: tl.constexpr, HQ: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
        HAS_QK_NORM: tl.constexpr, STAGE: tl.constexpr, HAS_SEEN: tl.constexpr, HAS_SUPP: tl.constexpr,
        BLOCK_V: tl.constexpr, KEY16: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK_H: tl.constexpr,
        BK_O: tl.constexpr, BK_I: tl.constexpr, RND: tl.constexpr, RND_C: tl.constexpr, PRECISE: tl.constexpr,
        LINE: tl.constexpr, PREFETCH: tl.constexpr, WIDE: tl.constexpr, BM1: tl.constexpr,
    ):  # fmt: skip
        """A whole frame: step 0 over 2 positions (the Talker's hidden state and code 0's embedding, in h),
        then steps 1..G-1 over the embedding of the code drawn before; codes_ptr [G, B]."""
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        epoch = 0
        for layer in range(L):  # step 0: positions 0 and 1 of every row
            nw, nn = _next_weights(layer, L, 0, qkv_w, s_wl_qkv, head_w, s_hg, NQKV * H, V * H)
            epoch = _layer(
                pid, nprog, bar_ptr, epoch, layer, h_ptr, codes_ptr, h_ptr, qkv_ptr, att_ptr, mid_ptr, act_ptr,
                nw, nn, ln1_ptr, qkv_w, qn_ptr, kn_ptr, o_w, ln2_ptr, gu_w, down_w, cos_ptr, sin_ptr, kc_ptr,
                vc_ptr, B, 0, eps, inv_d, scale, s_h, s_qkv, s_att, s_mid, s_act, s_h, s_wl_qkv, s_wl_o, s_wl_gu,
                s_wl_down, s_cly, s_cs, s_ch, s_cp, H, NQKV, INTER, 2, False, HQ, KV, D, P, HAS_QK_NORM, BM, BN, BK_H,
                BK_O, BK_I, RND, RND_C, PRECISE, LINE, PREFETCH, WIDE,
            )  # fmt: skip
        epoch = _head_and_draw(
            pid, nprog, bar_ptr, epoch, 0, h_ptr, logit_ptr, codes_ptr, fnorm_ptr, head_w, qkv_w, NQKV * H,
            slots_ptr, keys_ptr, temp_ptr, topk_ptr, topp_ptr, pen_ptr, dos_ptr, seed_ptr, seen_ptr, supp_ptr, B,
            eps, s_h, s_hg, s_logit, H, V, 2, STAGE, HAS_SEEN, HAS_SUPP, BLOCK_V, KEY16, BM, BN, BK_H, RND, PRECISE,
            LINE, PREFETCH,
        )  # fmt: skip
        for i in range(1, G):  # step i: position i + 1, input codec_embedding[i - 1] of code i
            emb = emb_w + (i - 1) * s_eg
            idx = codes_ptr + (i - 1) * B
            nw, nn = _next_weights(0, L, i, qkv_w, s_wl_qkv, head_w, s_hg, NQKV * H, V * H)
            epoch = _layer(  # layer 0 reads its input, and its residual, from the embedding table
                pid, nprog, bar_ptr, epoch, 0, emb, idx, h_ptr, qkv_ptr, att_ptr, mid_ptr, act_ptr, nw, nn,
                ln1_ptr, qkv_w, qn_ptr, kn_ptr, o_w, ln2_ptr, gu_w, down_w, cos_ptr, sin_ptr, kc_ptr, vc_ptr, B,
                i + 1, eps, inv_d, scale, s_h, s_qkv, s_att, s_mid, s_act, H, s_wl_qkv, s_wl_o, s_wl_gu, s_wl_down,
                s_cly, s_cs, s_ch, s_cp, H, NQKV, INTER, 1, True, HQ, KV, D, P, HAS_QK_NORM, BM1, BN, BK_H, BK_O,
                BK_I, RND, RND_C, PRECISE, LINE, PREFETCH, WIDE,
            )  # fmt: skip
            for layer in range(1, L):
                nw, nn = _next_weights(layer, L, i, qkv_w, s_wl_qkv, head_w, s_hg, NQKV * H, V * H)
                epoch = _layer(
                    pid, nprog, bar_ptr, epoch, layer, h_ptr, idx, h_ptr, qkv_ptr, att_ptr, mid_ptr, act_ptr, nw,
                    nn, ln1_ptr, qkv_w, qn_ptr, kn_ptr, o_w, ln2_ptr, gu_w, down_w, cos_ptr, sin_ptr, kc_ptr, vc_ptr,
                    B, i + 1, eps, inv_d, scale, s_h, s_qkv, s_att, s_mid, s_act, s_h, s_wl_qkv, s_wl_o, s_wl_gu,
                    s_wl_down, s_cly, s_cs, s_ch, s_cp, H, NQKV, INTER, 1, False, HQ, KV, D, P, HAS_QK_NORM, BM1,
                    BN, BK_H, BK_O, BK_I, RND, RND_C, PRECISE, LINE, PREFETCH, WIDE,
                )  # fmt: skip
            epoch = _head_and_draw(
                pid, nprog, bar_ptr, epoch, i, h_ptr, logit_ptr, codes_ptr, fnorm_ptr, head_w, qkv_w, NQKV * H,
                slots_ptr, keys_ptr, temp_ptr, topk_ptr, topp_ptr, pen_ptr, dos_ptr, seed_ptr, seen_ptr, supp_ptr, B,
                eps, s_h, s_hg, s_logit, H, V, 1, STAGE, HAS_SEEN, HAS_SUPP, BLOCK_V, KEY16, BM1, BN, BK_H, RND,
                PRECISE, LINE, PREFETCH,
            )  # fmt: skip


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def programs(device: torch.device) -> int:
    """The grid: one program per SM (all resident at once, as the barriers need); one in the interpreter,
    which runs programs one after another."""
    if device.type != "cuda" or _interpreting():
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


class PersistentFrame:
    """A `CodeFrame`'s frame of at most MAX_ROWS rows as one launch. Built from the CodeFrame's weights
    (stacked copies); called with the frame's `FrameDraws` (the sampler's tables on the device)."""

    def __init__(self, frame) -> None:
        require_triton()
        stack = lambda i: torch.stack([layer[i] for layer in frame.layers]).contiguous()  # noqa: E731
        self.ln1, self.qkv, self.o, self.ln2, self.gu, self.down = (stack(i) for i in (0, 1, 4, 5, 6, 7))
        self.qk_norm = frame.layers[0][2] is not None
        self.qn = stack(2) if self.qk_norm else self.ln1
        self.kn = stack(3) if self.qk_norm else self.ln1
        self.heads = torch.stack(frame.heads).contiguous()  # [G - 1, V, H]
        self.embeds = torch.stack(frame.embeds).contiguous()  # [G - 1, V, H]
        self.frame = frame

    def __call__(self, cp, talker_hidden: torch.Tensor, code0_embed: torch.Tensor, draws) -> torch.Tensor:
        f, cfg = self.frame, self.frame.cfg
        b, width = talker_hidden.shape
        if b > MAX_ROWS:
            raise ValueError(f"the persistent frame runs at most {MAX_ROWS} rows, got {b}")
        cache = cp._cache_for(b, talker_hidden)
        hq, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        inter = self.down.shape[2]
        nqkv = self.qkv.shape[1]
        groups = self.heads.shape[0]
        dev, dt = talker_hidden.device, self.heads.dtype
        h = torch.stack((talker_hidden, code0_embed), dim=1).view(2 * b, width)  # rows b * 2 + t
        qkv = torch.empty(2 * b, nqkv, dtype=dt, device=dev)
        att = torch.empty(2 * b, hq * d, dtype=dt, device=dev)
        mid = torch.empty(2 * b, width, dtype=dt, device=dev)
        act = torch.empty(2 * b, inter, dtype=dt, device=dev)
        logits = torch.empty(b, self.heads.shape[1], dtype=dt, device=dev)
        codes = torch.empty(groups, b, dtype=torch.int64, device=dev)
        s = draws.sampler
        seen, supp = s.seen, s.suppress
        vocab = self.heads.shape[1]
        kc, vc = cache.k, cache.v  # [layers, S, KV, P, D]
        bar = torch.zeros(1, dtype=torch.int32, device=dev)  # the barriers' counter: each graph its own
        per_sm, warps = PERSISTENT_BLOCKS["per_sm"], PERSISTENT_BLOCKS["num_warps"]
        if per_sm > 1 and per_sm * warps > 8:  # all must be resident: 255 registers a thread fit 8 warps an SM
            raise ValueError(f"{per_sm} programs of {warps} warps per SM may not all be resident (a hang)")
        bn, bk = PERSISTENT_BLOCKS["BN"], GEMV_BLOCKS["BK"]
        _frame[(programs(dev) * PERSISTENT_BLOCKS["per_sm"],)](
            h, qkv, att, mid, act, logits, codes, bar,
            self.ln1, self.qkv, self.qn, self.kn, self.o, self.ln2, self.gu, self.down, f.final_norm, self.heads,
            self.embeds, f.cos, f.sin, kc, vc,
            draws.slots, draws.base, s.temperature, s.top_k, s.top_p, s.repetition_penalty, s.do_sample, s.seed,
            seen if seen is not None else codes, supp if supp is not None else codes,
            b, f.eps, 1.0 / d, d**-0.5,
            h.stride(0), qkv.stride(0), att.stride(0), mid.stride(0), act.stride(0), logits.stride(0),
            self.qkv.stride(0), self.o.stride(0), self.gu.stride(0), self.down.stride(0), self.heads.stride(0),
            self.embeds.stride(0), kc.stride(0), kc.stride(1), kc.stride(2), kc.stride(3),
            H=width, NQKV=nqkv, INTER=inter, V=vocab, L=self.qkv.shape[0], G=groups, HQ=hq, KV=kv, D=d,
            P=max(next_pow2(cache.max_len), 2),
            HAS_QK_NORM=self.qk_norm, STAGE=s.stage, HAS_SEEN=seen is not None, HAS_SUPP=supp is not None,
            BLOCK_V=next_pow2(vocab), KEY16=SHORT_KEYS and dt == torch.bfloat16 and seen is None,
            BM=next_pow2(2 * b), BN=bn, BK_H=min(bk, next_pow2(width)), BK_O=min(bk, next_pow2(hq * d)),
            BK_I=min(bk, next_pow2(inter)), RND=f.rnd,
            RND_C=rnd(kc.dtype), PRECISE=precise(), LINE=128 // dt.itemsize,
            PREFETCH=PREFETCH and not _interpreting(), WIDE=PERSISTENT_BLOCKS["WIDE"], BM1=next_pow2(b),
            num_warps=PERSISTENT_BLOCKS["num_warps"],
        )  # fmt: skip
        return codes.t()  # [B, G]
