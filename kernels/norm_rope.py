"""Fused RMSNorm, and fused q/k RMSNorm + RoPE + KV-cache write, for decode: kernels beside the layers they equal.

Why: a graphed Thinker decode step spends ~2.5 ms of 9.9 in small elementwise kernels
(docs/performance.md, kernel profile). `layers.RMSNorm` is ~8 launches (cast, square, mean, + eps, rsqrt,
scale, cast, weight); the attention's post-projection work is q/k norm (2 x 8), RoPE (2 x 5: two
products, a rotate-half negation and cat, a sum) and two `index_put` cache writes with dtype casts: ~30 launches per
layer. Here that is one launch for each norm and one for all of q/k/v post-processing.

Numbers: the kernels round at the same points as the plain path (see `_triton.round_to`), so in bf16:
- RMSNorm: fp32 variance, `x * rsqrt(var + eps)` rounded to x's dtype, times the weight, rounded to the
  result dtype — as `layers.RMSNorm`. The sum of squares is a tree sum, not PyTorch's order, so the fp32
  rsqrt can differ by an ulp, and a bf16 output then, rarely, by one bf16 ulp.
- RoPE: `x * cos` and `rotate_half(x) * sin` each rounded, then their sum rounded — as `layers.apply_rope`
  (cos/sin are the tables the model already computed, in the activation dtype).
- cache write: the rotated k and the raw v cast to the cache dtype at `cache[layer, slot_b, :, pos_bt]`.
In fp32 the GPU compiler may contract a product and a sum into one FMA, which differs by an fp32 ulp.

The hooks (`install_rmsnorm`, `install_attention`) patch module instances from outside (the model files
stay the readable truth); each falls back to the plain forward for inputs it does not cover (more than
`max_rows` rows, i.e. prefill; mixed dtypes; a head_dim that is not a power of two).
"""

from __future__ import annotations

import torch
from omni_rt.kernels._common import FLOATS, mark, next_pow2, precise, require_triton, rnd

from omni_rt.model import layers


# ----------------------------------------------------------------------------------------------------
# Plain-PyTorch references: the layers' own code, whatever it is at the time
# ----------------------------------------------------------------------------------------------------
def rmsnorm_reference(norm: layers.RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """`layers.RMSNorm.forward` itself (the class's, even when the instance's forward is patched)."""
    return layers.RMSNorm.forward(norm, x)


# ----------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------
try:  # the kernels need Triton; the references and the hooks' plain fallbacks do not
    import triton
    import triton.language as tl
    from omni_rt.kernels._triton import round_to, rsqrt_f32
except ImportError:  # pragma: no cover - depends on the machine
    triton = None

if triton is not None:

    @triton.jit
    def _rmsnorm(
        x_ptr,  # [R, D] rows, unit stride along D
        w_ptr,  # [D]
        o_ptr,  # [R, D]
        D,
        stride_x,
        stride_o,
        eps,
        inv_d,  # 1/D in fp32: PyTorch's CUDA mean multiplies the sum by this host-computed factor
        BLOCK_D: tl.constexpr,
        RND_X: tl.constexpr,  # x's dtype: where `x * rsqrt(...)` is rounded (`h.to(dtype)`)
        RND_O: tl.constexpr,  # the output dtype: where `weight * h` is rounded
        PRECISE: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_D)
        m = cols < D
        x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
        var = tl.sum(x * x, axis=0) * inv_d
        h = round_to(x * rsqrt_f32(var + eps, PRECISE), RND_X)
        w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
        y = round_to(w * h, RND_O)
        tl.store(o_ptr + row * stride_o + cols, y.to(o_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _qk_norm_rope_cache(
        q_ptr,  # [B*T, HQ*D] q_proj output rows
        k_ptr,  # [B*T, KV*D]
        v_ptr,  # [B*T, KV*D]
        qw_ptr,  # [D] q_norm weight
        kw_ptr,  # [D] k_norm weight
        cos_ptr,  # [B*T, D]
        sin_ptr,  # [B*T, D]
        qo_ptr,  # [B, HQ, T, D] rotated q out
        kc_ptr,  # [S, KV, L, D] this layer's k cache
        vc_ptr,  # [S, KV, L, D]
        slots_ptr,  # [B]
        pos_ptr,  # [B*T]
        T,
        eps,
        stride_q,
        stride_k,
        stride_v,
        stride_cs,
        stride_cslot,
        stride_chead,
        stride_cpos,
        HQ: tl.constexpr,
        D: tl.constexpr,
        HAS_NORM: tl.constexpr,
        RND: tl.constexpr,  # the activation dtype (q, k, norm weights, cos, sin all share it)
        RND_C: tl.constexpr,  # the cache dtype
        PRECISE: tl.constexpr,
    ):
        tok = tl.program_id(0)  # b * T + t
        head = tl.program_id(1)  # q heads 0..HQ-1, then kv heads
        d = tl.arange(0, D)
        rot = (d + D // 2) % D  # rotate_half: element d takes x[d + D/2] (negated) or x[d - D/2]
        sign = tl.where(d < D // 2, -1.0, 1.0)
        if head < HQ:
            src = q_ptr + tok.to(tl.int64) * stride_q + head * D
            w_base = qw_ptr
        else:
            src = k_ptr + tok.to(tl.int64) * stride_k + (head - HQ) * D
            w_base = kw_ptr
        x = tl.load(src + d).to(tl.float32)
        xr = tl.load(src + rot).to(tl.float32)
        if HAS_NORM:
            r = rsqrt_f32(tl.sum(x * x, axis=0) * (1.0 / D) + eps, PRECISE)  # mean as PyTorch's: sum * (1/D)
            x = round_to(tl.load(w_base + d).to(tl.float32) * round_to(x * r, RND), RND)
            xr = round_to(tl.load(w_base + rot).to(tl.float32) * round_to(xr * r, RND), RND)
        c = tl.load(cos_ptr + tok * stride_cs + d).to(tl.float32)
        s = tl.load(sin_ptr + tok * stride_cs + d).to(tl.float32)
        out = round_to(round_to(x * c, RND) + round_to(sign * xr * s, RND), RND)
        if head < HQ:
            b = tok // T
            t = tok % T
            dst = qo_ptr + ((b.to(tl.int64) * HQ + head) * T + t) * D
            tl.store(dst + d, out.to(qo_ptr.dtype.element_ty))
        else:
            kh = head - HQ
            slot = tl.load(slots_ptr + tok // T).to(tl.int64)
            pos = tl.load(pos_ptr + tok).to(tl.int64)
            off = slot * stride_cslot + kh * stride_chead + pos * stride_cpos + d
            tl.store(kc_ptr + off, round_to(out, RND_C).to(kc_ptr.dtype.element_ty))
            val = tl.load(v_ptr + tok.to(tl.int64) * stride_v + kh * D + d).to(tl.float32)
            tl.store(vc_ptr + off, round_to(val, RND_C).to(vc_ptr.dtype.element_ty))


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, num_warps: int = 4) -> torch.Tensor:
    """x [..., D] -> RMSNorm(x) [..., D] in the dtype `weight * x` promotes to; one launch."""
    require_triton()
    kernel = _rmsnorm
    d = x.shape[-1]
    x2 = x.reshape(-1, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)  # [R, D]
    if x2.shape[0]:
        kernel[(x2.shape[0],)](
            x2,
            weight,
            out,
            d,
            x2.stride(0),
            out.stride(0),
            eps,
            1.0 / d,
            BLOCK_D=next_pow2(d),
            RND_X=rnd(x.dtype),
            RND_O=rnd(out_dtype),
            PRECISE=precise(),
            num_warps=num_warps,
        )
    return out.view(x.shape)


def qk_norm_rope_cache(
    q: torch.Tensor,  # [B, T, Hq*D]
    k: torch.Tensor,  # [B, T, KV*D]
    v: torch.Tensor,  # [B, T, KV*D]
    q_weight: torch.Tensor | None,  # [D], None: no q/k norm
    k_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,  # [B, T, D]
    sin: torch.Tensor,
    k_cache: torch.Tensor,  # [S, KV, L, D]
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # [B]
    positions: torch.Tensor,  # [B, T]
    *,
    num_warps: int = 1,
) -> torch.Tensor:  # [B, Hq, T, D]
    """q/k RMSNorm, RoPE on q and k, k and v written at `cache[slot_b, :, positions[b, t]]`: one launch.

    q, k, v, the norm weights, cos and sin must share one dtype (the model's); D a power of two.
    """
    require_triton()
    kernel = _qk_norm_rope_cache
    b, t = q.shape[:2]
    _, kv, _, d = k_cache.shape  # [S, KV, L, D]
    hq = q.shape[-1] // d
    if k.shape[-1] != kv * d or v.shape != k.shape or v_cache.stride() != k_cache.stride():
        raise ValueError(
            f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
            f"k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
        )
    if d & (d - 1) or k_cache.stride(-1) != 1:
        raise ValueError(f"head_dim {d} must be a power of two with unit stride in the cache")
    q2, k2, v2 = (z.reshape(b * t, -1) for z in (q, k, v))
    q2, k2, v2 = (z if z.stride(-1) == 1 else z.contiguous() for z in (q2, k2, v2))
    cos2, sin2 = cos.reshape(b * t, d).contiguous(), sin.reshape(b * t, d).contiguous()
    pos = positions.reshape(b * t).contiguous()
    slots = slots.contiguous()  # the kernel reads slot b at slots_ptr + b
    out = torch.empty(b, hq, t, d, dtype=q.dtype, device=q.device)
    has_norm = q_weight is not None
    kernel[(b * t, hq + kv)](
        q2,
        k2,
        v2,
        q_weight if has_norm else q2,  # unread without the norm
        k_weight if has_norm else k2,
        cos2,
        sin2,
        out,
        k_cache,
        v_cache,
        slots,
        pos,
        t,
        eps,
        q2.stride(0),
        k2.stride(0),
        v2.stride(0),
        cos2.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        HQ=hq,
        D=d,
        HAS_NORM=has_norm,
        RND=rnd(q.dtype),
        RND_C=rnd(k_cache.dtype),
        PRECISE=precise(),
        num_warps=num_warps,
    )
    return out


# ----------------------------------------------------------------------------------------------------
# Hooks
# ----------------------------------------------------------------------------------------------------
def fused_rmsnorm_forward(norm: layers.RMSNorm, max_rows: int | None = None):
    """A `forward` for one RMSNorm instance: the kernel for up to `max_rows` rows, else the plain one."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(x.shape[-1], 1)
        if (max_rows is not None and rows > max_rows) or x.dtype not in FLOATS or x.requires_grad:
            return rmsnorm_reference(norm, x)
        return rmsnorm(x, norm.weight, norm.eps)

    return mark(forward, "rmsnorm")


def _attention_fits(
    attn: layers.Attention, x: torch.Tensor, cos: torch.Tensor, cache: layers.KVCache
) -> bool:
    """Metadata checks only (no GPU values read): the kernel covers this call."""
    dt = x.dtype
    same = [attn.q_proj.weight.dtype, cos.dtype]
    if attn.use_qk_norm:
        same += [attn.q_norm.weight.dtype, attn.k_norm.weight.dtype]
    d = attn.head_dim
    return (
        dt in FLOATS
        and all(z == dt for z in same)
        and cache.dtype in FLOATS
        and d & (d - 1) == 0
        and cache.k.stride(-1) == 1
        and not x.requires_grad
    )


def fused_qkv_fn(attn: layers.Attention, max_rows: int | None = 16):
    """An `Attention.qkv_fn` for one layer: q/k norm, RoPE and the cache write in one launch; calls the
    kernel does not cover (more than `max_rows` token rows, other dtypes) take `layers.qk_norm_rope_cache`."""

    def qkv_fn(attn, q, k, v, cos, sin, cache, slots, positions):
        b, t = q.shape[:2]
        if (max_rows is not None and b * t > max_rows) or not _attention_fits(attn, q, cos, cache):
            return layers.qk_norm_rope_cache(attn, q, k, v, cos, sin, cache, slots, positions)
        norm = attn.use_qk_norm
        return qk_norm_rope_cache(
            q,
            k,
            v,
            attn.q_norm.weight if norm else None,
            attn.k_norm.weight if norm else None,
            attn.q_norm.eps if norm else 0.0,
            cos,
            sin,
            cache.k[attn.layer_idx],
            cache.v[attn.layer_idx],
            slots,
            positions,
        )  # [B, Hq, T, D]

    return mark(qkv_fn, "attention")


def install_rmsnorm(model: torch.nn.Module, max_rows: int | None = 16) -> int:
    """Patch every `layers.RMSNorm` in `model` (Thinker, Talker, code predictor, Code2Wav transformer)."""
    require_triton()
    changed = 0
    for m in model.modules():
        if isinstance(m, layers.RMSNorm):
            m.forward = fused_rmsnorm_forward(m, max_rows)
            changed += 1
    return changed


def install_attention(model: torch.nn.Module, max_rows: int | None = 16) -> int:
    """Patch every `layers.Attention` in `model` (not Code2Wav's own attention class: no cache, no norm)."""
    require_triton()
    changed = 0
    for m in model.modules():
        if isinstance(m, layers.Attention):
            m.qkv_fn = fused_qkv_fn(m, max_rows)
            changed += 1
    return changed
