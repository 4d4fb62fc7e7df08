"""Code2Wav's streaming step in fewer launches: fused kernels beside the model code they equal, and the
hooks that install them (`install_code2wav`, the fused kernel "code2wav").

Why: every audio chunk of every conversation is one `Code2Wav.step`, and a graphed step is ~620 kernels
whatever its size: 2.07 ms for a 1-frame chunk of one stream on an H200, of which ~1.86 ms is kernel
time at ~3 µs a kernel (docs/performance.md, 2026-12-03). In the pipeline each of those kernels also waits
for the Thinker's and Talker's kernels on the other streams, so a first chunk took 4.8 ms there. What the
hooks remove, per step at the real shapes:

| where                      | plain                                                | here        |
|----------------------------|------------------------------------------------------|-------------|
| transformer, per layer     | q, k, v GEMMs; RoPE on q and k (2 x 5 launches)      | 1 GEMM + 1  |
| transformer, per layer     | two LayerScale products and two residual sums        | 2           |
| transformer, per layer     | gate and up GEMMs                                    | 1 GEMM      |
| decoder block              | the start mask (~6 launches) and its masked_fill      | 1           |
| residual unit              | residual sum + masked_fill                           | 1           |
| conv that looks back       | cat of context and input, then the context update   | 1           |
| the last conv (to 1 channel) | cuDNN's generic kernel (2.3 ms at 8 rows x 16 frames) | 1 (Triton)  |

Numbers: as the plain path's, rounded at its rounding points (`_triton.round_to`): RoPE as
`layers.apply_rope` (each product rounded, then the sum), `x + scale * h` with the product rounded, the
residual sum rounded, masks and copies exact. So in bf16 the kernels' outputs are bit-equal, but for the
last conv, which sums its 7 x C products in fp32 in another order than cuDNN (an ulp of the PCM); the packed
GEMMs (`packed.pack_linears`) sum in cuBLAS's order for the packed shape, which can move a bf16 value by
an ulp, as `packed.install_packed` does for the Thinker. In fp32 a product and a sum may be contracted
into one FMA on the GPU (an fp32 ulp).

The hooks fill the attention's `qkv_fn` seam and patch module instances (`forward` of the MLP and
transformer layers, `step` of the decoder blocks and the convs that look back), and each falls back to the plain code for inputs it does
not cover. Offline `Code2Wav.forward` keeps the plain path except where it shares a patched `forward`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from omni_rt.kernels._common import FLOATS, mark, next_pow2, require_triton, rnd
from omni_rt.kernels.moe_decode import triton_cdiv
from omni_rt.kernels.packed import pack_linears, packed_mlp_forward

from omni_rt.model import code2wav as c2w

try:  # the kernels need Triton; the hooks' plain fallbacks do not
    import triton
    import triton.language as tl
    from omni_rt.kernels._triton import round_to
except ImportError:  # pragma: no cover - depends on the machine
    triton = None

if triton is not None:

    @triton.jit
    def _rope_qk(
        q_ptr,  # [B*T rows, HQ*D], row stride stride_q (a slice of the packed q/k/v GEMM's output)
        k_ptr,  # [B*T rows, HK*D], row stride stride_k
        cos_ptr,  # [B*T, D] contiguous
        sin_ptr,
        oq_ptr,  # [B*T, HQ, D] contiguous
        ok_ptr,  # [B*T, HK, D] contiguous
        HQ,
        HK,
        stride_q,
        stride_k,
        D: tl.constexpr,
        RND: tl.constexpr,
    ):
        """One (row, head) per program: x cos + rotate_half(x) sin on q's heads, then k's."""
        r = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        half = tl.arange(0, D // 2)
        if h < HQ:
            src = q_ptr + r * stride_q + h * D
            dst = oq_ptr + (r * HQ + h) * D
        else:
            src = k_ptr + r * stride_k + (h - HQ) * D
            dst = ok_ptr + (r * HK + h - HQ) * D
        x1 = tl.load(src + half).to(tl.float32)
        x2 = tl.load(src + D // 2 + half).to(tl.float32)
        c1 = tl.load(cos_ptr + r * D + half).to(tl.float32)
        c2 = tl.load(cos_ptr + r * D + D // 2 + half).to(tl.float32)
        s1 = tl.load(sin_ptr + r * D + half).to(tl.float32)
        s2 = tl.load(sin_ptr + r * D + D // 2 + half).to(tl.float32)
        # rotate_half(x) = [-x2, x1]; each product rounded, then the sum (layers.apply_rope)
        y1 = round_to(round_to(x1 * c1, RND) + round_to(-x2 * s1, RND), RND)
        y2 = round_to(round_to(x2 * c2, RND) + round_to(x1 * s2, RND), RND)
        tl.store(dst + half, y1.to(dst.dtype.element_ty))
        tl.store(dst + D // 2 + half, y2.to(dst.dtype.element_ty))

    @triton.jit
    def _scale_add(
        x_ptr,  # [R, H] contiguous
        s_ptr,  # [H]
        h_ptr,  # [R, H] contiguous
        o_ptr,  # [R, H]
        H,
        BLOCK: tl.constexpr,
        RND: tl.constexpr,
    ):
        """x + scale * h, the product rounded, then the sum (TransformerLayer with LayerScale)."""
        r = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = c < H
        x = tl.load(x_ptr + r * H + c, mask=m, other=0.0).to(tl.float32)
        h = tl.load(h_ptr + r * H + c, mask=m, other=0.0).to(tl.float32)
        s = tl.load(s_ptr + c, mask=m, other=0.0).to(tl.float32)
        y = round_to(x + round_to(s * h, RND), RND)
        tl.store(o_ptr + r * H + c, y.to(o_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _start_mask(
        x_ptr,  # [B, C, L], strides sxb, sxc, sxt
        y_ptr,  # [B, C, L] added to x when HAS_Y, strides syb, syc, syt
        pos_ptr,  # [B] int64: the frame the chunk starts at
        o_ptr,  # [B, C, L] contiguous
        C,
        L,
        sxb,
        sxc,
        sxt,
        syb,
        syc,
        syt,
        rate,
        lag,
        HAS_Y: tl.constexpr,
        BLOCK: tl.constexpr,
        RND: tl.constexpr,
    ):
        """(x [+ y]) where the sample lies at or after the stream's first one, else 0: the plain block's
        `started` mask (`Code2WavState.started`) and its masked_fill, with the residual sum rounded."""
        row = tl.program_id(0).to(tl.int64)  # b * C + c
        b = row // C
        ch = row % C
        t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = t < L
        first = tl.load(pos_ptr + b) * rate - lag  # global index of the chunk's first sample
        x = tl.load(x_ptr + b * sxb + ch * sxc + t * sxt, mask=m, other=0.0).to(tl.float32)
        if HAS_Y:
            y = tl.load(y_ptr + b * syb + ch * syc + t * syt, mask=m, other=0.0).to(tl.float32)
            x = round_to(x + y, RND)
        x = tl.where(first + t >= 0, x, 0.0)
        tl.store(o_ptr + row * L + t, x.to(o_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _window(
        buf_ptr,  # [B, C, CTX] contiguous: the conv's last CTX inputs, updated in place
        x_ptr,  # [B, C, T], strides sxb, sxc, sxt
        o_ptr,  # [B, C, CTX + T] contiguous: cat([buf, x], -1)
        valid_ptr,  # [B] int64 when RAGGED: each stream's own frames of the chunk
        C,
        CTX,
        T,
        sxb,
        sxc,
        sxt,
        rate,  # input samples per frame (RAGGED)
        RAGGED: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """One row (b, c) per program: the conv's input window, then its last CTX samples into `buf`
        (`Code2WavState.keep_context`: ragged, the CTX before the row's first padded sample).
        The new context is read back from this program's own output after a barrier, so it may overlap
        the old one (T < CTX) without a race."""
        row = tl.program_id(0).to(tl.int64)
        b = row // C
        ch = row % C
        n = CTX + T
        out = o_ptr + row * n
        for start in range(0, n, BLOCK):
            i = start + tl.arange(0, BLOCK)
            from_buf = i < CTX
            v_buf = tl.load(buf_ptr + row * CTX + i, mask=from_buf, other=0.0)
            v_x = tl.load(x_ptr + b * sxb + ch * sxc + (i - CTX) * sxt, mask=(i >= CTX) & (i < n), other=0.0)
            tl.store(out + i, tl.where(from_buf, v_buf, v_x), mask=i < n)
        tl.debug_barrier()
        keep = T
        if RAGGED:
            keep = tl.load(valid_ptr + b) * rate
        for start in range(0, CTX, BLOCK):
            j = start + tl.arange(0, BLOCK)
            mj = j < CTX
            tl.store(buf_ptr + row * CTX + j, tl.load(out + keep + j, mask=mj, other=0.0), mask=mj)

    @triton.jit
    def _conv_to_one(
        w_ptr,  # [C, K] contiguous: the weight of a conv with one output channel
        bias_ptr,  # [1]
        x_ptr,  # [B, C, L] contiguous: the input window, L = T + (K - 1)
        o_ptr,  # [B, 1, T] contiguous
        C,
        L,
        T,
        K: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK: tl.constexpr,
        RND: tl.constexpr,
    ):
        """A stride-1, dilation-1 conv to one channel: out[b, t] = bias + sum_{c, j} w[c, j] x[b, c, t + j],
        summed in fp32 and rounded once, as cuDNN does (in another order)."""
        b = tl.program_id(0).to(tl.int64)
        t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = t < T
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for c in range(C):
            row = x_ptr + (b * C + c) * L
            for j in tl.static_range(K):
                w = tl.load(w_ptr + c * K + j).to(tl.float32)
                acc += w * tl.load(row + t + j, mask=m, other=0.0).to(tl.float32)
        if HAS_BIAS:
            acc += tl.load(bias_ptr).to(tl.float32)
        tl.store(o_ptr + b * T + t, round_to(acc, RND).to(o_ptr.dtype.element_ty), mask=m)


# ----------------------------------------------------------------------------------------------------
# Launchers (each equal to a line of the plain model code, named in its docstring)
# ----------------------------------------------------------------------------------------------------
def rope_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int
):
    """`layers.apply_rope` on q [B, T, heads*D] and k [B, T, kv_heads*D] (rows may be strided), in one
    launch; returns them as [B, heads, T, D] and [B, kv_heads, T, D] (views of [B, T, H, D] storage)."""
    require_triton()
    B, T, _ = q.shape
    D = cos.shape[-1]
    cos, sin = (
        cos.expand(B, T, D).contiguous(),
        sin.expand(B, T, D).contiguous(),
    )  # views: no copy when [B, T, D]
    oq = torch.empty(B, T, heads, D, dtype=q.dtype, device=q.device)
    ok = torch.empty(B, T, kv_heads, D, dtype=k.dtype, device=k.device)
    if B * T:
        _rope_qk[(B * T, heads + kv_heads)](
            q, k, cos, sin, oq, ok, heads, kv_heads, q.stride(1), k.stride(1), D=D, RND=rnd(q.dtype)
        )
    return oq.transpose(1, 2), ok.transpose(1, 2)


def scale_add(x: torch.Tensor, scale: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """`x + LayerScale(h)` (x + scale * h) in one launch; x, h [..., H] contiguous."""
    require_triton()
    H = x.shape[-1]
    out = torch.empty_like(x)
    rows = x.numel() // H if H else 0
    if rows:
        block = min(1024, next_pow2(H))
        _scale_add[(rows, triton_cdiv(H, block))](x, scale, h, out, H, BLOCK=block, RND=rnd(x.dtype))
    return out


def start_mask(
    x: torch.Tensor, pos: torch.Tensor, rate: int, lag: int, y: torch.Tensor | None = None
) -> torch.Tensor:
    """`(x [+ y]).masked_fill(~state.started(rate, lag, L), 0)` in one launch; x, y [B, C, L]."""
    require_triton()
    B, C, L = x.shape
    out = torch.empty(B, C, L, dtype=x.dtype, device=x.device)
    yy = x if y is None else y
    if out.numel():
        block = min(1024, next_pow2(L))
        _start_mask[(B * C, triton_cdiv(L, block))](
            x, yy, pos, out, C, L, *x.stride(), *yy.stride(), rate, lag,
            HAS_Y=y is not None, BLOCK=block, RND=rnd(x.dtype),
        )  # fmt: skip
    return out


def window(
    buf: torch.Tensor, x: torch.Tensor, valid: torch.Tensor | None = None, rate: int = 1
) -> torch.Tensor:
    """`w = torch.cat([buf, x], -1); state.keep_context(buf, w, rate)` in one launch (`valid`: the state's
    ragged frame counts, or None); buf [B, C, ctx] contiguous."""
    require_triton()
    B, C, T = x.shape
    ctx = buf.shape[-1]
    out = torch.empty(B, C, ctx + T, dtype=x.dtype, device=x.device)
    if B * C:
        block = min(1024, next_pow2(ctx + T))
        _window[(B * C,)](
            buf, x, out, buf if valid is None else valid, C, ctx, T, *x.stride(), rate,
            RAGGED=valid is not None, BLOCK=block,
        )  # fmt: skip
    return out


def conv_to_one(window_x: torch.Tensor, conv: torch.nn.Conv1d) -> torch.Tensor:
    """`conv(window_x)` for a stride-1, dilation-1, ungrouped conv with one output channel (Code2Wav's
    last conv, to the waveform: cuDNN runs it as a generic kernel, 2.3 ms of an 8-row 16-frame step)."""
    require_triton()
    B, C, L = window_x.shape
    K = conv.kernel_size[0]
    T = L - K + 1
    x = window_x.contiguous()
    out = torch.empty(B, 1, T, dtype=x.dtype, device=x.device)
    bias = conv.bias if conv.bias is not None else conv.weight
    if out.numel():
        block = min(256, next_pow2(T))
        _conv_to_one[(B, triton_cdiv(T, block))](
            conv.weight.reshape(C, K), bias, x, out, C, L, T,
            K=K, HAS_BIAS=conv.bias is not None, BLOCK=block, RND=rnd(x.dtype),
        )  # fmt: skip
    return out


# ----------------------------------------------------------------------------------------------------
# Hooks
# ----------------------------------------------------------------------------------------------------
def _covers(*ts: torch.Tensor) -> bool:
    """Inputs the kernels take: one floating dtype, no autograd."""
    return all(t.dtype == ts[0].dtype and t.dtype in FLOATS and not t.requires_grad for t in ts)


def _attention_qkv(attn: c2w.Attention):
    packed = pack_linears(attn, ("q_proj", "k_proj", "v_proj"))
    sizes = [attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0], attn.v_proj.weight.shape[0]]

    def qkv(attn, x, cos, sin):
        D = attn.head_dim
        if D % 2 or D & (D - 1) or not _covers(x, cos, sin, packed) or cos.dim() != 3:
            return c2w.Attention.qkv(attn, x, cos, sin)
        B, T, _ = x.shape
        q, k, v = F.linear(x, packed).split(sizes, dim=-1)  # one GEMM, three row-strided views
        q, k = rope_qk(q, k, cos, sin, attn.n_heads, attn.n_kv)
        return q, k, v.view(B, T, attn.n_kv, D).transpose(1, 2)

    return mark(qkv, "code2wav")


def _layer_forward(layer: c2w.TransformerLayer):
    plain = c2w.TransformerLayer.forward.__get__(layer)
    s1, s2 = layer.self_attn_layer_scale.scale, layer.mlp_layer_scale.scale

    def forward(x, cos, sin, mask, past=None):
        if not _covers(x, s1, s2) or not x.is_contiguous():
            return plain(x, cos, sin, mask, past)
        h, k, v = layer.self_attn(layer.input_layernorm(x), cos, sin, mask, past)
        x = scale_add(x, s1, h.contiguous())
        x = scale_add(x, s2, layer.mlp(layer.post_attention_layernorm(x)).contiguous())
        return x, k, v

    return mark(forward, "code2wav")


def _block_step(block: c2w.DecoderBlock):
    plain = c2w.DecoderBlock.step.__get__(block)
    act, up = block.block[0], block.block[1]

    def step(x, state):
        if not _covers(x) or state.pos.device != x.device:
            return plain(x, state)
        rate, lag = block.samples_per_frame, block.lag
        x = start_mask(up.step(act(x), state), state.pos, rate, lag)
        for unit in block.block[2:]:
            y = unit.conv2.step(unit.act2(unit.conv1.step(unit.act1(x), state)), state)
            x = start_mask(x, state.pos, rate, lag, y=y)  # the residual sum, then the mask
        return x

    return mark(step, "code2wav")


def _conv_step(conv: c2w.CausalConv1d | c2w.CausalTransConv1d):
    plain = type(conv).step.__get__(conv)
    transposed = isinstance(conv, c2w.CausalTransConv1d)
    cv = conv.conv
    to_one = not transposed and cv.out_channels == 1 and cv.groups == 1 and cv.dilation == (1,)
    to_one = to_one and cv.stride == (1,) and cv.padding == (0,)

    def step(x, state):
        buf = state.conv[conv]
        if not _covers(x, buf, cv.weight) or not buf.is_contiguous():
            return plain(x, state)
        w = window(buf, x, state.valid, conv.rate)
        if to_one:
            return conv_to_one(w, cv)
        return conv.forward(w) if transposed else cv(w)

    return mark(step, "code2wav")


def install_code2wav(model: torch.nn.Module) -> int:
    """Patch every Code2Wav module these kernels cover in `model`; returns the count."""
    require_triton()
    changed = 0
    for m in model.modules():
        if isinstance(m, c2w.Attention):
            m.qkv_fn = _attention_qkv(m)
        elif isinstance(m, c2w.Mlp):
            m.forward = mark(packed_mlp_forward(m, pack_linears(m, ("gate_proj", "up_proj"))), "code2wav")
        elif isinstance(m, c2w.TransformerLayer):
            m.forward = _layer_forward(m)
        elif isinstance(m, c2w.DecoderBlock):
            m.step = _block_step(m)
        elif isinstance(m, c2w.CausalConv1d | c2w.CausalTransConv1d) and m.context:
            m.step = _conv_step(m)
        else:
            continue
        changed += 1
    return changed
