"""Layers shared by the Thinker, the Talker and the code predictor.

Public API (keep stable; add, don't rename):

    RMSNorm(dim: int, eps: float = 1e-6)                      forward(x[..., dim]) -> same shape
    rope_inv_freq(head_dim: int, theta: float, device=None) -> Tensor[head_dim // 2] (fp32)
    rope_cos_sin(positions, head_dim, theta, mrope_section=(), dtype=float32) -> (cos, sin) [B, T, head_dim]
        positions: LongTensor[B, T] (text) or [3, B, T] (t, h, w for interleaved M-RoPE)
    apply_rope(x[B, heads, T, D], cos[B, T, D], sin[B, T, D]) -> x rotated
    Rotary(head_dim: int, theta: float, mrope_section: tuple = ())
                                                              forward(positions, dtype) -> (cos, sin)
    KVCache(n_layers, n_slots, n_kv_heads, max_len, head_dim, device=None, dtype=float32)
        .k, .v: [n_layers, n_slots, n_kv_heads, max_len, head_dim]; .reset(slot); .max_len; .n_slots
    Attention(cfg: DecoderConfig, layer_idx: int)
        forward(x[B, T, H], cos, sin, cache: KVCache, slots[B], positions[B, T], kv_len: int | None = None,
                mask=None) -> [B, T, H];  .qkv_fn / .attn_fn: optional callables with the signatures
        of `qk_norm_rope_cache` / `attend`, set from outside (kernels/)
    qk_norm_rope_cache(attn, q, k, v, cos, sin, cache, slots, positions) -> q[B, heads, T, D]
        (q/k norm, RoPE, and the new k/v rows written into attn's layer of the cache)
    attention_mask(positions[B, T], kv_len: int, rep: int) -> [B, 1, rep*T, kv_len] bool
    attend(q[B, heads, T, D], k_cache[S, KV, L, D], v_cache, slots[B], positions[B, T], mask, kv_len)
        -> [B, heads, T, D]   (plain SDPA over rows [0, kv_len) of each slot; causal, unmasked when T == kv_len)
    MLP(hidden_size: int, intermediate_size: int)             forward(x[..., H]) -> [..., H]
    Experts(num_experts: int, hidden_size: int, intermediate_size: int)
        parameters gate_up_proj [E, 2I, H], down_proj [E, H, I]
    experts_loop / experts_gather / experts_grouped_mm(x[N, H], ids[N, K], weights[N, K], gate_up, down) -> [N, H]
    grouped_mm_available(x, gate_up) -> bool
    SparseMoe(cfg: DecoderConfig, impl: str = "auto")         forward(x[B, T, H]) -> [B, T, H]
        .route(x[N, H]) -> (weights[N, K] in x.dtype, ids[N, K]);  .impl in MOE_IMPLS;
        .experts_fn: optional callable with the experts_* signature, set from outside (kernels/)
    DecoderLayer(cfg: DecoderConfig, layer_idx: int, moe_impl: str = "auto")
        forward(x[B, T, H], cos, sin, cache, slots, positions, kv_len=None, mask=None) -> [B, T, H]
        (MoE mlp when cfg.is_moe, else a dense MLP of cfg.intermediate_size: the code predictor's layer)

Names of parameters are the checkpoint's (q_proj, k_proj, ..., mlp.gate.weight, mlp.experts.gate_up_proj,
mlp.shared_expert.*, mlp.shared_expert_gate.weight), so `state_dict()` keys equal the reference's.

The KV cache is static: a sequence owns a slot, new k/v are written at their absolute positions, and a
query at position p attends to cache rows <= p of its slot. Stale rows beyond p (from an earlier occupant
of the slot, or from right-padding in a batched prefill) are never seen, because a sequence writes row p
before any of its queries can see it. So reusing a slot needs no reset.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from omni_rt.errors import ConfigError, InvalidRequestError
from omni_rt.model.config import DecoderConfig

# ---------------------------------------------------------------------------------------------------------
# Normalisation


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # variance in fp32 and the weight applied after casting back, as the reference does (bit-equal in bf16)
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


# ---------------------------------------------------------------------------------------------------------
# Rotary position embedding (plain and interleaved multimodal)


def rope_inv_freq(head_dim: int, theta: float, device: torch.device | str | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], fp32."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))


def _mrope_axis(half: int, mrope_section: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Which position component (0 = t, 1 = h, 2 = w) drives each of the `half` frequencies.

    Interleaved M-RoPE (Qwen3-Omni): frequency j uses h when j % 3 == 1 and j < 3 * sections[1], w when
    j % 3 == 2 and j < 3 * sections[2], and t otherwise. [half], int64
    """
    j = torch.arange(half, device=device)
    axis = torch.zeros(half, dtype=torch.long, device=device)
    axis = torch.where((j % 3 == 1) & (j < 3 * mrope_section[1]), 1, axis)
    axis = torch.where((j % 3 == 2) & (j < 3 * mrope_section[2]), 2, axis)
    return axis


def rope_cos_sin(
    positions: torch.Tensor,
    head_dim: int,
    theta: float,
    mrope_section: tuple[int, ...] = (),
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [B, T, head_dim] for `positions` [B, T] (text) or [3, B, T] (t, h, w).

    Computed in fp32 and cast to `dtype` at the end, like the reference. Without `mrope_section` the
    positions must be [B, T] (plain RoPE, the code predictor). With it, [B, T] text positions are used for
    all three components, which reduces to plain RoPE.
    """
    inv_freq = rope_inv_freq(head_dim, theta, positions.device)  # [D/2]
    # text positions ([B, T]: t == h == w) make M-RoPE plain RoPE exactly, so skip the component select
    if mrope_section and positions.dim() != 2:
        if positions.dim() != 3 or positions.shape[0] != 3:
            raise ValueError(f"M-RoPE positions must be [B, T] or [3, B, T], got {tuple(positions.shape)}")
        freqs = positions.float().unsqueeze(-1) * inv_freq  # [3, B, T, D/2]
        axis = _mrope_axis(inv_freq.shape[0], mrope_section, positions.device)  # [D/2]
        freqs = torch.where(axis == 1, freqs[1], torch.where(axis == 2, freqs[2], freqs[0]))  # [B, T, D/2]
    else:
        if positions.dim() != 2:
            raise ValueError(f"RoPE positions must be [B, T], got {tuple(positions.shape)}")
        freqs = positions.float().unsqueeze(-1) * inv_freq  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, D]; cos, sin [B, T, D]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


class Rotary(nn.Module):
    """Holds a decoder's RoPE settings; no buffers, so weights loading and `.to(dtype)` cannot disturb it.

    The inverse frequencies are recomputed each call (a [D/2] arange: negligible, and graph-capturable).
    """

    def __init__(self, head_dim: int, theta: float, mrope_section: tuple[int, ...] = ()) -> None:
        super().__init__()
        if mrope_section and 2 * sum(mrope_section) != head_dim:
            raise ConfigError(f"mrope_section {mrope_section} must sum to head_dim/2 = {head_dim // 2}")
        self.head_dim = head_dim
        self.theta = theta
        self.mrope_section = tuple(mrope_section)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(positions, self.head_dim, self.theta, self.mrope_section, dtype)


# ---------------------------------------------------------------------------------------------------------
# Static KV cache


class KVCache:
    """k, v: [n_layers, n_slots, n_kv_heads, max_len, head_dim], allocated once."""

    def __init__(
        self,
        n_layers: int,
        n_slots: int,
        n_kv_heads: int,
        max_len: int,
        head_dim: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if min(n_layers, n_slots, n_kv_heads, max_len, head_dim) <= 0:
            raise ConfigError(
                f"KVCache sizes must be positive: layers={n_layers} slots={n_slots} kv_heads={n_kv_heads} "
                f"max_len={max_len} head_dim={head_dim}"
            )
        shape = (n_layers, n_slots, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)

    @property
    def n_slots(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def device(self) -> torch.device:
        return self.k.device

    def check_access(
        self,
        cfg: DecoderConfig,
        x: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        kv_len: int | None,
        who: str,
    ) -> None:
        """Check one forward's inputs [B, T, H], positions [B, T] and slots [B] against this cache.

        Shapes always; values only on the CPU (reading GPU values would sync with the host).
        `who` names the decoder in the error ("Thinker", "Talker").
        """
        if x.dim() != 3 or x.shape[1] == 0 or x.shape[2] != cfg.hidden_size:
            raise InvalidRequestError(
                f"inputs_embeds must be [B, T, {cfg.hidden_size}] with T > 0, got {tuple(x.shape)}"
            )
        b, t = x.shape[:2]
        if tuple(positions.shape) != (b, t):
            raise InvalidRequestError(f"positions must be [B, T] = {[b, t]}, got {tuple(positions.shape)}")
        if tuple(slots.shape) != (b,):
            raise InvalidRequestError(f"slots must be [B] = [{b}], got {tuple(slots.shape)}")
        want = (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
        if (self.k.shape[0], self.k.shape[2], self.k.shape[4]) != want:
            raise InvalidRequestError(f"cache shape {tuple(self.k.shape)} does not fit this {who}")
        if t > self.max_len:
            raise InvalidRequestError(f"{t} new tokens exceed the cache length {self.max_len}")
        limit = self.max_len
        if kv_len is not None:
            if not 0 < kv_len <= self.max_len:
                raise InvalidRequestError(f"kv_len {kv_len} outside 1..{self.max_len} (the cache length)")
            limit = kv_len
        if positions.device.type == "cpu" and (positions.min() < 0 or positions.max() >= limit):
            raise InvalidRequestError(f"positions must be in [0, {limit}) (the cache length or kv_len)")
        if slots.device.type == "cpu" and (slots.min() < 0 or slots.max() >= self.n_slots):
            raise InvalidRequestError(f"slots must be in [0, {self.n_slots})")

    def reset(self, slot: int) -> None:
        """Zero one slot. Not needed for correctness (see the module docstring); useful for debugging."""
        self.k[:, slot].zero_()
        self.v[:, slot].zero_()


# ---------------------------------------------------------------------------------------------------------
# Attention


class Attention(nn.Module):
    """GQA self-attention with per-head q/k RMSNorm, RoPE and a static slot cache."""

    def __init__(self, cfg: DecoderConfig, layer_idx: int) -> None:
        super().__init__()
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads {cfg.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {cfg.num_key_value_heads}"
            )
        self.layer_idx = layer_idx
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.n_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.n_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=False)
        self.use_qk_norm = cfg.use_qk_norm
        if cfg.use_qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        # set from outside to swap in fused kernels: the q/k/v projections (x -> (q, k, v)), q/k norm +
        # RoPE + cache write (signature of `qk_norm_rope_cache`), and the attention (signature of `attend`)
        self.proj_fn: ProjFn | None = None
        self.qkv_fn: QkvFn | None = None
        self.attn_fn: AttnFn | None = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache,
        slots: torch.Tensor,
        positions: torch.Tensor,
        kv_len: int | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [B, T, H] at `positions` [B, T] of cache rows `slots` [B] -> [B, T, H].

        kv_len (a Python int, static per CUDA graph): attend over cache rows [0, kv_len) only; must exceed
        every position. Defaults to the whole cache. mask: `attention_mask(positions, kv_len, rep)`,
        computed once per forward by the caller to save kernels; built here when absent.
        """
        b, t, _ = x.shape
        if self.proj_fn is not None:
            q, k, v = self.proj_fn(self, x)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # [B, T, heads * D]
        q = (self.qkv_fn or qk_norm_rope_cache)(self, q, k, v, cos, sin, cache, slots, positions)
        k_cache, v_cache = cache.k[self.layer_idx], cache.v[self.layer_idx]  # [S, KV, L, D]
        kv_len = cache.max_len if kv_len is None else kv_len
        if mask is None:
            mask = attention_mask(positions, kv_len, self.n_heads // self.n_kv_heads)
        fn = self.attn_fn if self.attn_fn is not None else attend
        out = fn(q, k_cache, v_cache, slots, positions, mask, kv_len)  # [B, heads, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


AttnFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor
]


def qk_norm_rope_cache(
    attn: Attention,
    q: torch.Tensor,  # [B, T, Hq * D] q_proj output
    k: torch.Tensor,  # [B, T, KV * D]
    v: torch.Tensor,  # [B, T, KV * D]
    cos: torch.Tensor,  # [B, T, D]
    sin: torch.Tensor,
    cache: KVCache,
    slots: torch.Tensor,  # [B]
    positions: torch.Tensor,  # [B, T]
) -> torch.Tensor:
    """Between the projections and the attention: per-head q/k RMSNorm, RoPE, and the new rows of k and v
    written into `attn`'s layer of the cache. Returns q [B, Hq, T, D]."""
    b, t = q.shape[:2]
    d = attn.head_dim
    q, k, v = (
        q.view(b, t, attn.n_heads, d),
        k.view(b, t, attn.n_kv_heads, d),
        v.view(b, t, attn.n_kv_heads, d),
    )
    if attn.use_qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = (
        apply_rope(q.transpose(1, 2), cos, sin),
        apply_rope(k.transpose(1, 2), cos, sin),
    )  # [B, heads, T, D]
    # write the new rows: cache[layer][slot_b, :, positions[b, t]] = k[b, :, t]. The two advanced
    # indices are split by a slice, so the indexed view is [B, T, KV, D]: write k as [B, T, KV, D].
    k_cache, v_cache = cache.k[attn.layer_idx], cache.v[attn.layer_idx]  # [S, KV, L, D]
    k_cache[slots.view(b, 1), :, positions] = k.transpose(1, 2).to(k_cache.dtype)
    v_cache[slots.view(b, 1), :, positions] = v.to(v_cache.dtype)
    return q


QkvFn = Callable[..., torch.Tensor]  # the signature of `qk_norm_rope_cache`
ProjFn = Callable[["Attention", torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def attention_mask(positions: torch.Tensor, kv_len: int, rep: int) -> torch.Tensor:
    """[B, 1, rep*T, kv_len] bool: query (head group r, token t) sees cache rows <= positions[b, t].

    The `rep` query heads sharing a kv head are folded into the query length (see `attend`).
    """
    b, t = positions.shape
    rows = torch.arange(kv_len, device=positions.device)  # [kv_len]
    mask = rows.view(1, 1, -1) <= positions.view(b, t, 1)  # [B, T, kv_len]
    return mask.unsqueeze(1).expand(b, rep, t, kv_len).reshape(b, 1, rep * t, kv_len)


def attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    mask: torch.Tensor,
    kv_len: int,
) -> torch.Tensor:
    """The plain attention over the static cache (SDPA); a fused kernel can replace it via `attn_fn`.

    q [B, heads, T, D] (rotated); k_cache, v_cache [S, KV, L, D] (this layer's, new rows written);
    slots [B]; positions [B, T]; mask from `attention_mask`; kv_len: rows [0, kv_len) are read.
    Returns [B, heads, T, D]. `positions` is unused here (the mask encodes it); kernels may use it.
    A prefill of rows [0, kv_len) (T == kv_len) is SDPA's causal call without the mask, the reference's.
    """
    b, n_heads, t, d = q.shape
    n_kv = k_cache.shape[1]
    keys = k_cache[slots, :, :kv_len].to(q.dtype)  # [B, KV, kv_len, D]
    values = v_cache[slots, :, :kv_len].to(q.dtype)  # [B, KV, kv_len, D]
    if t == kv_len:
        # A sequence's new tokens have consecutive positions, all below kv_len, so t == kv_len means every
        # row is a prefill of rows [0, t): the mask is plain causal. Call SDPA as the reference's prefill
        # does (is_causal, GQA, no mask): in bf16 the kernel and its rounding depend on the call (CUDA
        # picks flash attention only without a mask); on the CPU it is bit-equal to the reference's.
        return F.scaled_dot_product_attention(
            q, keys, values, is_causal=True, scale=d**-0.5, enable_gqa=n_kv != n_heads
        )
    # GQA without copying k/v per query head: the query heads that share a kv head are folded into the
    # query length (head h uses kv head h // rep, as repeat_interleave would give). Masked rows still
    # change how SDPA blocks its reductions, so bf16 results move by an ulp with kv_len (~0.3 % of outputs
    # on the CPU): the price of a static cache, which the reference's static-cache decode pays too.
    q = q.reshape(b, n_kv, (n_heads // n_kv) * t, d)  # [B, KV, rep*T, D]
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=d**-0.5)  # [B, KV, rep*T, D]
    return out.view(b, n_heads, t, d)


# ---------------------------------------------------------------------------------------------------------
# Feed-forward: dense SwiGLU and sparse MoE


class MLP(nn.Module):
    """Dense SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """Packed expert weights, laid out as transformers >= 5 holds them in memory."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))


ExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def experts_loop(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """The readable truth: one matmul pair per expert that has tokens, summed in expert order.

    x [N, H]; ids, weights [N, K]; gate_up [E, 2I, H]; down [E, H, I] -> [N, H]. Same accumulation order
    as the reference's loop, so it is bit-equal to it. `unique()` syncs with the host: CPU path.
    """
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        tok, kpos = torch.where(ids == e)  # [n_e] each
        gate, up = F.linear(x[tok], gate_up[e]).chunk(2, dim=-1)  # [n_e, I] each
        y = F.linear(F.silu(gate) * up, down[e]) * weights[tok, kpos, None]  # [n_e, H]
        out.index_add_(0, tok, y.to(out.dtype))
    return out


def experts_gather(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """Static shapes, no host sync: gathers each token's K experts' weights. For small N (decode)."""
    gu = gate_up[ids]  # [N, K, 2I, H]
    h = (gu @ x[:, None, :, None]).squeeze(-1)  # [N, K, 2I]
    gate, up = h.chunk(2, dim=-1)  # [N, K, I]
    y = (down[ids] @ (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)  # [N, K, H]
    return (y * weights.unsqueeze(-1)).sum(dim=1)  # [N, H]


def _grouped_mm_fn() -> Callable | None:
    # torch.nn.functional.grouped_mm (torch >= 2.10) or the older private torch._grouped_mm
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_mm_available(x: torch.Tensor, gate_up: torch.Tensor) -> bool:
    """The grouped-GEMM path runs only on CUDA (SM80+) in bf16; elsewhere it falls back to the loop."""
    return (
        _grouped_mm_fn() is not None
        and x.is_cuda
        and x.dtype == torch.bfloat16
        and gate_up.dtype == torch.bfloat16
        and torch.cuda.get_device_capability(x.device) >= (8, 0)
    )


def experts_grouped_mm(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """Tokens sorted by expert, two grouped GEMMs. No host sync, so it can be CUDA-graphed.

    Needs 16-byte aligned row strides (H and I multiples of 8 in bf16).
    """
    mm = _grouped_mm_fn()
    n, k = ids.shape
    n_experts = gate_up.shape[0]
    flat = ids.reshape(-1)  # [S = N*K]
    order = torch.argsort(flat, stable=True)  # [S], rows grouped by expert
    tok = order // k  # [S], source token of each row
    # rows per expert by scatter_add (bincount would size its output from the data: a host sync)
    counts = torch.zeros(n_experts, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)  # [E], end row of each expert's group
    h = mm(x[tok], gate_up.transpose(-2, -1), offs=offs)  # [S, 2I]
    gate, up = h.chunk(2, dim=-1)
    y = mm((F.silu(gate) * up).contiguous(), down.transpose(-2, -1), offs=offs)  # [S, H]
    y = y * weights.reshape(-1)[order, None]  # [S, H], rounded to x.dtype like the reference
    # Back to (token, k) order and summed over k in one reduction (fp32 accumulation for bf16), as the
    # reference's grouped_mm backend does. index_add_ into a bf16 buffer would round after every add on
    # CUDA (atomics, in arrival order: also not deterministic).
    rows = torch.empty_like(y).index_copy_(0, order, y)  # [S, H], row n*K + j = token n's j-th expert
    return rows.view(n, k, -1).sum(dim=1)  # [N, H]


MOE_IMPLS = ("auto", "loop", "gather", "grouped_mm")


class SparseMoe(nn.Module):
    """Top-k routed experts (+ the Talker's sigmoid-gated shared expert when configured).

    Router: softmax over experts in fp32, top-k, renormalised when `norm_topk_prob`, weights cast back to
    the activation dtype, as in the reference. `impl` picks the expert computation: "loop" (exact, CPU),
    "gather" (static shapes, small batches), "grouped_mm" (CUDA bf16), or "auto" (grouped_mm where
    available, else loop). `experts_fn`, when set from outside (e.g. a fused kernel), overrides `impl`.
    """

    def __init__(self, cfg: DecoderConfig, impl: str = "auto") -> None:
        super().__init__()
        if impl not in MOE_IMPLS:
            raise ConfigError(f"unknown MoE implementation {impl!r}; choose one of {MOE_IMPLS}")
        if not 0 < cfg.num_experts_per_tok <= cfg.num_experts:
            raise ConfigError(
                f"num_experts_per_tok {cfg.num_experts_per_tok} must be in 1..num_experts ({cfg.num_experts})"
            )
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.impl = impl
        self.experts_fn: ExpertsFn | None = None
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # weight [E, H]
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_expert: MLP | None = None
        if cfg.shared_expert_intermediate_size > 0:
            self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)  # weight [1, H]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> (weights [N, K] in x.dtype, expert ids [N, K])."""
        logits = self.gate(x)  # [N, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top_w, top_i = torch.topk(probs, self.top_k, dim=-1)  # [N, K]
        if self.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        return top_w.to(logits.dtype), top_i

    def _experts_fn(self, x: torch.Tensor) -> ExpertsFn:
        if self.experts_fn is not None:
            return self.experts_fn
        impl = self.impl
        if impl == "auto":
            impl = "grouped_mm" if grouped_mm_available(x, self.experts.gate_up_proj) else "loop"
        return {"loop": experts_loop, "gather": experts_gather, "grouped_mm": experts_grouped_mm}[impl]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [N, H]
        weights, ids = self.route(flat)
        fn = self._experts_fn(flat)
        out = fn(flat, ids, weights, self.experts.gate_up_proj, self.experts.down_proj)  # [N, H]
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.view(shape)


# ---------------------------------------------------------------------------------------------------------
# Decoder layer


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then h + mlp(norm(h)); MoE mlp when cfg.is_moe, else dense."""

    def __init__(self, cfg: DecoderConfig, layer_idx: int, moe_impl: str = "auto") -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: SparseMoe | MLP = (
            SparseMoe(cfg, moe_impl) if cfg.is_moe else MLP(cfg.hidden_size, cfg.intermediate_size)
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache,
        slots: torch.Tensor,
        positions: torch.Tensor,
        kv_len: int | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, slots, positions, kv_len, mask)
        return h + self.mlp(self.post_attention_layernorm(h))
