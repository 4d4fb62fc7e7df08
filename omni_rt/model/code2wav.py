"""Code2Wav: the vocoder that turns the Talker's 16-code frames into 24 kHz PCM, offline and streaming.

Structure (parameter names are the checkpoint's, relative to `code2wav.`):

    code_embedding           16 codebooks in one table; a frame's embedding is the mean over its 16 codes
    pre_transformer          causal transformer, sliding window of `sliding_window` frames, layer scale,
                             RoPE, no q/k norm                                    [B, N, H]
    upsample.{i}             transposed conv (kernel == stride) + ConvNeXt block  [B, H, N * prod(ratios)]
    decoder.0                causal conv H -> decoder_dim
    decoder.{1..k}           SnakeBeta, transposed conv (kernel 2r, stride r), 3 residual units
    decoder.{-2,-1}          SnakeBeta, causal conv -> 1 channel; clamped to [-1, 1]

Why streaming can be exact. Everything is causal except the decoder's transposed convs: with kernel 2r
and r samples trimmed at both ends, the r outputs of input sample q also need input q + 1. The reference
drops those outputs at the end of a decode, so n frames give `samples_per_frame * n - shortfall`
samples (1920 n - 555 for the real model); the last `shortfall` samples of a frame's span depend on the
next frame. The stream state (`Code2WavState`, run by `code2wav_stream.Code2WavStream`) keeps, per
stream: a ring of the last `sliding_window` frames' keys and values per layer (at their absolute RoPE
positions), the last inputs of every causal conv, and the last input of every look-ahead transposed
conv. Each pushed chunk then yields exactly the samples the offline decode has at those indices, and
nothing more, so the concatenation equals `Code2Wav.forward` of all frames and `flush()` has nothing
left to add.

The per-chunk step (`Code2Wav.step`) has static shapes for a fixed chunk size and keeps all positions on
the device, so it can be captured in a CUDA graph per chunk size. See `Code2Wav.step`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from omni_rt.errors import ConfigError, InvalidRequestError
from omni_rt.model.config import Code2WavConfig
from omni_rt.model.layers import RMSNorm, apply_rope, rope_cos_sin

# ---------------------------------------------------------------------------------------------------------
# Stream state


@dataclass
class Code2WavState:
    """Decode state of a batch of streams, allocated once (`Code2Wav.new_state`) and updated in place.

    pos      [B]                    frames decoded so far: the absolute position of each stream's next frame
    k, v     [L, B, Hkv, W + 1, D]  keys/values of the last W = sliding_window frames, slot = position % W;
                                    slot W is a spare that takes the writes of frames no later chunk sees
    key_pos  [B, W + 1]             absolute frame held by each ring slot, -1 while empty (slot W: always)
    conv     module -> [B, C, ctx]  the last `ctx` inputs of each conv that looks back (zeros at start,
                                    which is the reference's zero padding)
    valid    [B] or None            ragged chunks: how many of this chunk's T frames are each stream's own
                                    (the rest pad the row to T and leave no trace); None: all T. Set by
                                    the caller before a step (a graph's static input, like the codes).
    """

    pos: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    key_pos: torch.Tensor
    conv: dict[nn.Module, torch.Tensor]
    valid: torch.Tensor | None = None

    def reset(self, row: int | None = None) -> None:
        """Start stream `row` (or every stream) afresh."""
        rows = slice(None) if row is None else slice(row, row + 1)
        self.pos[rows] = 0
        self.key_pos[rows] = -1
        self.k[:, rows] = 0  # not needed for correctness (key_pos masks them), but keeps stale data out
        self.v[:, rows] = 0
        for buf in self.conv.values():
            buf[rows] = 0

    def row(self, i: int) -> Code2WavState:
        """Stream `i` alone, as a one-stream state of views (writes to it go to this state)."""
        return Code2WavState(
            pos=self.pos[i : i + 1], k=self.k[:, i : i + 1], v=self.v[:, i : i + 1],
            key_pos=self.key_pos[i : i + 1], conv={m: buf[i : i + 1] for m, buf in self.conv.items()},
        )  # fmt: skip

    def _per_stream(self) -> list[tuple[torch.Tensor, int]]:
        """Every per-stream tensor with its stream dim (`valid`, a step's input, is not state)."""
        return [
            (self.pos, 0),
            (self.k, 1),
            (self.v, 1),
            (self.key_pos, 0),
            *((b, 0) for b in self.conv.values()),
        ]

    def gather(self, pool: Code2WavState, index: torch.Tensor) -> None:
        """Stream i of this state <- the pool's stream index[i], for every i (one kernel a tensor): a work
        state loaded from a pool of streams (the pipeline keeps one per session slot), decoded, then
        `scatter`ed back. Both states come from the same model's `new_state`."""
        for (dst, dim), (src, _) in zip(self._per_stream(), pool._per_stream(), strict=True):
            torch.index_select(src, dim, index, out=dst)

    def scatter(self, pool: Code2WavState, index: torch.Tensor) -> None:
        """The pool's stream index[i] <- stream i of this state, for every i. Rows that pad a batch may all
        name one scratch stream of the pool: which of them lands there is unspecified."""
        for (src, dim), (dst, _) in zip(self._per_stream(), pool._per_stream(), strict=True):
            dst.index_copy_(dim, index, src)

    def keep_context(self, buf: torch.Tensor, window: torch.Tensor, rate: int) -> None:
        """buf [B, C, ctx] <- the last ctx samples of each stream's own input in `window` [B, C, ctx + T
        rate] (the conv's old context, then this chunk's input at `rate` samples per frame)."""
        ctx = buf.shape[-1]
        if self.valid is None:
            buf.copy_(window[..., -ctx:])
            return
        idx = (self.valid * rate)[:, None] + torch.arange(ctx, device=buf.device)  # [B, ctx]
        buf.copy_(window.gather(-1, idx[:, None, :].expand(-1, window.shape[1], -1)))

    def started(self, rate: int, lag: int, length: int) -> torch.Tensor:
        """[B, 1, length] bool: which samples of this chunk (at `rate` samples per frame, running `lag`
        samples behind the frames) lie at or after the stream's first sample. Only a stream's first
        chunk has samples before its start; they must be zero so later convs see the reference's padding."""
        first = self.pos * rate - lag  # [B] global index of the chunk's first sample
        idx = first[:, None] + torch.arange(length, device=self.pos.device)  # [B, length]
        return (idx >= 0).unsqueeze(1)


# ---------------------------------------------------------------------------------------------------------
# Convolutions: offline `forward(x)` and streaming `step(x, state)` share the weights and the arithmetic


class CausalConv1d(nn.Module):
    """Stride-1 causal conv: output t sees inputs t - ctx .. t, with zeros before the start."""

    def __init__(self, cin: int, cout: int, kernel: int, dilation: int = 1, groups: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, dilation=dilation, groups=groups)
        self.context = (kernel - 1) * dilation
        self.rate = 1  # input samples per frame, set by Code2Wav from the whole stack (ragged chunks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (self.context, 0)))  # [B, C, T] -> [B, Cout, T]

    def step(self, x: torch.Tensor, state: Code2WavState) -> torch.Tensor:
        if self.context == 0:
            return self.conv(x)
        buf = state.conv[self]  # [B, C, ctx]
        x = torch.cat([buf, x], dim=-1)  # [B, C, ctx + T]
        state.keep_context(buf, x, self.rate)
        return self.conv(x)  # [B, Cout, T]


class CausalTransConv1d(nn.Module):
    """Transposed conv (kernel a multiple of stride s) with `kernel - s` samples trimmed at both ends.

    Output t needs inputs t // s .. t // s + context, where context = kernel / s - 1: the look-ahead
    that makes the last samples of a decode depend on the next frame (context 1 in the decoder blocks,
    0 in the upsampler where kernel == stride).
    """

    def __init__(self, cin: int, cout: int, kernel: int, stride: int) -> None:
        super().__init__()
        if kernel % stride:
            raise ConfigError(f"transposed conv kernel {kernel} must be a multiple of its stride {stride}")
        self.conv = nn.ConvTranspose1d(cin, cout, kernel, stride=stride)
        self.stride = stride
        self.trim = kernel - stride
        self.context = kernel // stride - 1
        self.rate = 1  # input samples per frame, set by Code2Wav from the whole stack (ragged chunks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)  # [B, Cout, (T - 1) s + kernel]
        return y[..., self.trim : y.shape[-1] - self.trim]  # [B, Cout, (T - context) s]

    def step(self, x: torch.Tensor, state: Code2WavState) -> torch.Tensor:
        """[B, C, T] -> [B, Cout, T s]: the outputs completed by these T inputs (those of the previous
        `context` inputs and of all but the last `context` new ones)."""
        if self.context:
            buf = state.conv[self]  # [B, C, context]
            x = torch.cat([buf, x], dim=-1)
            state.keep_context(buf, x, self.rate)
        return self.forward(x)


class SnakeBeta(nn.Module):
    """x + sin^2(x e^alpha) / e^beta, per channel. Maps 0 to 0, which the stream's start masking uses."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))  # log-scale, as in the checkpoint
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = self.alpha.exp()[None, :, None]  # [1, C, 1]
        beta = self.beta.exp()[None, :, None]
        return x + (1.0 / (beta + 1e-9)) * torch.sin(x * alpha).pow(2)

    def step(self, x: torch.Tensor, state: Code2WavState) -> torch.Tensor:
        return self.forward(x)


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = CausalConv1d(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def _pointwise(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        h = h.transpose(1, 2)  # [B, T, C]
        h = self.pwconv2(F.gelu(self.pwconv1(self.norm(h))))
        return x + (self.gamma * h).transpose(1, 2)  # [B, C, T]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._pointwise(x, self.dwconv(x))

    def step(self, x: torch.Tensor, state: Code2WavState) -> torch.Tensor:
        return self._pointwise(x, self.dwconv.step(x, state))


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int) -> None:
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv1d(dim, dim, 7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv1d(dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(self.act2(self.conv1(self.act1(x))))

    def step(self, x: torch.Tensor, state: Code2WavState) -> torch.Tensor:
        return x + self.conv2(self.act2(self.conv1.step(self.act1(x), state)))


class DecoderBlock(nn.Module):
    """SnakeBeta, transposed conv upsampling by `rate`, residual units of dilation 1, 3, 9."""

    def __init__(self, cin: int, cout: int, rate: int) -> None:
        super().__init__()
        self.block = nn.ModuleList(
            [SnakeBeta(cin), CausalTransConv1d(cin, cout, 2 * rate, rate)]
            + [ResidualUnit(cout, d) for d in (1, 3, 9)]
        )
        # Set by Code2Wav from the whole conv stack: output samples per frame, and how many samples
        # the output runs behind the frames (the look-ahead accumulated up to and including this block).
        self.samples_per_frame = 0
        self.lag = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.block:
            x = layer(x)
        return x

    def step(self, x: torch.Tensor, state: Code2WavState) -> torch.Tensor:
        x = self.block[1].step(self.block[0](x), state)  # [B, Cout, T r]
        # In a stream's first chunk the first `lag` outputs precede the stream (the reference trims them
        # away); zeroing them (and the residual units' outputs there) is what the reference's zero
        # padding of the following causal convs sees. A no-op on every later chunk.
        started = state.started(self.samples_per_frame, self.lag, x.shape[-1])  # [B, 1, T r]
        x = x.masked_fill(~started, 0.0)
        for unit in self.block[2:]:
            x = unit.step(x, state).masked_fill(~started, 0.0)
        return x


# ---------------------------------------------------------------------------------------------------------
# Transformer over frames


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """[B, 1, T, S] bool: query at frame p sees keys at frames p - window < k <= p (k >= 0 is a key).

    q_pos [B, T], k_pos [B, S] absolute frames; k_pos = -1 marks an empty cache slot.
    """
    d = q_pos[:, :, None] - k_pos[:, None, :]  # [B, T, S]
    return ((d >= 0) & (d < window) & (k_pos[:, None, :] >= 0)).unsqueeze(1)


class Attention(nn.Module):
    def __init__(self, cfg: Code2WavConfig) -> None:
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)
        # set from outside to compute q, k, v in fused kernels (kernels/code2wav_step.py), same contract as `qkv`
        self.qkv_fn: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [B, T, H] -> q [B, Hq, T, D], k and v [B, Hkv, T, D]; q and k rotated."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # [B, Hq, T, D]
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)  # [B, Hkv, T, D]
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, H]; past: cached (k, v) [B, Hkv, S, D] seen before the new keys; mask [B, 1, T, S + T].

        Returns (out [B, T, H], k, v [B, Hkv, T, D] of the new frames, rotated, for the caller's cache)."""
        B, T, _ = x.shape
        q, k, v = (self.qkv_fn or Attention.qkv)(self, x, cos, sin)
        keys, values = k, v
        if past is not None:
            keys, values = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)  # [B, Hkv, S+T, D]
        if self.n_kv != self.n_heads:
            keys = keys.repeat_interleave(self.n_heads // self.n_kv, dim=1)
            values = values.repeat_interleave(self.n_heads // self.n_kv, dim=1)
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)  # [B, Hq, T, D]
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1)), k, v


class Mlp(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LayerScale(nn.Module):
    def __init__(self, dim: int, init: float) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), init))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


class TransformerLayer(nn.Module):
    def __init__(self, cfg: Code2WavConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = Mlp(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn_layer_scale = LayerScale(cfg.hidden_size, cfg.layer_scale_initial_scale)
        self.mlp_layer_scale = LayerScale(cfg.hidden_size, cfg.layer_scale_initial_scale)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, H] -> (x [B, T, H], this layer's new k, v [B, Hkv, T, D])."""
        h, k, v = self.self_attn(self.input_layernorm(x), cos, sin, mask, past)
        x = x + self.self_attn_layer_scale(h)
        x = x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))
        return x, k, v


class Transformer(nn.Module):
    def __init__(self, cfg: Code2WavConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList([TransformerLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Offline: x [B, N, H] of frames 0..N-1 -> [B, N, H]."""
        B, N, _ = x.shape
        pos = torch.arange(N, device=x.device).expand(B, N)  # [B, N]
        cos, sin = rope_cos_sin(pos, self.cfg.head_dim, self.cfg.rope_theta, dtype=x.dtype)
        mask = window_mask(pos, pos, self.cfg.sliding_window)
        for layer in self.layers:
            x, _, _ = layer(x, cos, sin, mask)
        return self.norm(x)

    def step(self, x: torch.Tensor, state: Code2WavState) -> torch.Tensor:
        """Streaming: x [B, T, H] of frames pos..pos+T-1 -> [B, T, H]; writes their keys to the ring."""
        B, T, _ = x.shape
        W = self.cfg.sliding_window
        t = torch.arange(T, device=x.device)
        q_pos = state.pos[:, None] + t  # [B, T]
        cos, sin = rope_cos_sin(q_pos, self.cfg.head_dim, self.cfg.rope_theta, dtype=x.dtype)
        mask = window_mask(q_pos, torch.cat([state.key_pos, q_pos], dim=1), W)  # [B, 1, T, W + 1 + T]
        # Into the ring go the frames later chunks can see: a stream's own (`valid`), its last W of them
        # (so no two share a slot when T > W). The others (padding of a ragged chunk, or seen by no later
        # query) go to the spare slot W, which stays empty (key_pos -1): a fixed-shape scatter, no trace.
        if state.valid is None and T <= W:  # every frame (the common case: no mask to compute)
            slots, kept = q_pos % W, q_pos
        else:
            own = T if state.valid is None else state.valid[:, None]
            keep = (t >= own - W) & (t < own)  # [T] or [B, T]
            slots, kept = torch.where(keep, q_pos % W, W), torch.where(keep, q_pos, -1)  # [B, T]
        idx = slots[:, None, :, None].expand(B, state.k.shape[2], T, state.k.shape[4])  # [B, Hkv, T, D]
        for i, layer in enumerate(self.layers):
            x, k, v = layer(x, cos, sin, mask, (state.k[i], state.v[i]))
            state.k[i].scatter_(2, idx, k)
            state.v[i].scatter_(2, idx, v)
        state.key_pos.scatter_(1, slots, kept)
        return self.norm(x)


# ---------------------------------------------------------------------------------------------------------
# The model


def check_codes(codes: torch.Tensor, cfg: Code2WavConfig, what: str = "codes", values: bool = True) -> None:
    """Raise InvalidRequestError unless `codes` is an integer [..., num_quantizers, n >= 1] in range.

    The range check (`values`) reads the codes: a host sync when they are on the GPU."""
    if not isinstance(codes, torch.Tensor):
        raise InvalidRequestError(f"{what} must be a torch.Tensor, got {type(codes).__name__}")
    if codes.dtype.is_floating_point or codes.dtype.is_complex or codes.dtype == torch.bool:
        raise InvalidRequestError(f"{what} must be an integer tensor, got {codes.dtype}")
    if codes.dim() < 2 or codes.shape[-2] != cfg.num_quantizers:
        raise InvalidRequestError(
            f"{what} must be [..., {cfg.num_quantizers} quantizers, frames], got shape {tuple(codes.shape)}"
        )
    if codes.shape[-1] == 0:
        raise InvalidRequestError(f"{what} has no frames (shape {tuple(codes.shape)})")
    if not values:
        return
    lo, hi = int(codes.min()), int(codes.max())
    if lo < 0 or hi >= cfg.codebook_size:
        raise InvalidRequestError(
            f"{what} out of range: values in [{lo}, {hi}], codebook has {cfg.codebook_size} codes"
        )


class Code2Wav(nn.Module):
    def __init__(self, cfg: Code2WavConfig) -> None:
        super().__init__()
        n_blocks = len(cfg.upsample_rates)
        if cfg.decoder_dim % 2**n_blocks:
            raise ConfigError(f"decoder_dim {cfg.decoder_dim} must be divisible by 2^{n_blocks}")
        if cfg.hidden_size % cfg.num_attention_heads or cfg.num_attention_heads % cfg.num_key_value_heads:
            raise ConfigError("code2wav hidden_size / attention heads / kv heads do not divide")
        self.cfg = cfg
        self.code_embedding = nn.Embedding(cfg.codebook_size * cfg.num_quantizers, cfg.hidden_size)
        self.pre_transformer = Transformer(cfg)
        self.upsample = nn.ModuleList(
            nn.ModuleList(
                [CausalTransConv1d(cfg.hidden_size, cfg.hidden_size, f, f), ConvNeXtBlock(cfg.hidden_size)]
            )
            for f in cfg.upsampling_ratios
        )
        dims = [cfg.decoder_dim // 2**i for i in range(n_blocks + 1)]
        self.decoder = nn.ModuleList(
            [CausalConv1d(cfg.hidden_size, cfg.decoder_dim, 7)]
            + [DecoderBlock(dims[i], dims[i + 1], r) for i, r in enumerate(cfg.upsample_rates)]
            + [SnakeBeta(dims[-1]), CausalConv1d(dims[-1], 1, 7)]
        )

        # Walk the conv stack: `rate` samples per frame, and `lag` samples by which the completed output
        # runs behind the frames decoded. Causal convs keep both; a transposed conv of stride s and
        # look-ahead c maps (rate, lag) to (rate s, (lag + c) s). The real model: 1920 and 555.
        # Each conv also learns its input's samples per frame (`rate`): a ragged chunk keeps as context
        # the samples before its first padded frame, at valid * rate.
        rate, lag = 1, 0
        for up, convnext in self.upsample:
            up.rate = rate
            rate, lag = rate * up.stride, (lag + up.context) * up.stride
            convnext.dwconv.rate = rate
        assert lag == 0  # kernel == stride: the ConvNeXt stage never sees samples before a stream's start
        self.decoder[0].rate = rate
        for block in self.decoder[1:-2]:
            t = block.block[1]
            t.rate = rate
            rate, lag = rate * t.stride, (lag + t.context) * t.stride
            block.samples_per_frame, block.lag = rate, lag
            for unit in block.block[2:]:
                unit.conv1.rate = unit.conv2.rate = rate
        self.decoder[-1].rate = rate
        self.samples_per_frame = rate
        self.shortfall = lag  # the last `shortfall` samples of n frames' span need frame n + 1

    def output_length(self, n_frames: int) -> int:
        """Samples decoded from n frames (offline, and in total when streamed)."""
        return max(self.samples_per_frame * n_frames - self.shortfall, 0)

    def embed(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, Q, N] -> [B, N, H]: mean of the frame's Q code embeddings (codebook q at offset q V)."""
        offset = torch.arange(self.cfg.num_quantizers, device=codes.device) * self.cfg.codebook_size
        return self.code_embedding(codes + offset[None, :, None]).mean(1)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """Offline decode: codes [B, Q, N] -> wav [B, 1, samples_per_frame N - shortfall] in [-1, 1]."""
        if codes.dim() != 3:
            raise InvalidRequestError(
                f"codes must be [B, quantizers, frames], got shape {tuple(codes.shape)}"
            )
        check_codes(codes, self.cfg)
        if self.output_length(codes.shape[-1]) == 0:
            raise InvalidRequestError(f"{codes.shape[-1]} frames are too few to decode a sample")
        x = self.pre_transformer(self.embed(codes)).transpose(1, 2)  # [B, H, N]
        for up, convnext in self.upsample:
            x = convnext(up(x))
        for layer in self.decoder:
            x = layer(x)
        return x.clamp(-1.0, 1.0)

    @torch.no_grad()
    def new_state(self, batch_size: int = 1) -> Code2WavState:
        """Zeroed streaming state for `batch_size` streams, on this model's device and dtype."""
        p = self.code_embedding.weight
        cfg = self.cfg
        W, L = cfg.sliding_window, cfg.num_hidden_layers
        kv = torch.zeros(  # W slots and the spare (Transformer.step)
            L, batch_size, cfg.num_key_value_heads, W + 1, cfg.head_dim, device=p.device, dtype=p.dtype
        )
        conv = {}
        for m in self.modules():
            if isinstance(m, CausalConv1d | CausalTransConv1d) and m.context:
                conv[m] = torch.zeros(
                    batch_size, m.conv.in_channels, m.context, device=p.device, dtype=p.dtype
                )
        return Code2WavState(
            pos=torch.zeros(batch_size, dtype=torch.long, device=p.device),
            k=kv,
            v=kv.clone(),
            key_pos=torch.full((batch_size, W + 1), -1, dtype=torch.long, device=p.device),
            conv=conv,
        )

    @torch.no_grad()
    def step(self, codes: torch.Tensor, state: Code2WavState) -> torch.Tensor:
        """One streaming chunk, no input checks: codes [B, Q, T] -> wav [B, 1, samples_per_frame T].

        The output of stream b covers its samples [spf pos_b - shortfall, spf (pos_b + T) - shortfall)
        (pos_b before the call); in a stream's first chunk the part before sample 0 is to be dropped.
        `state` is updated in place (pos += T). Ragged (`state.valid`): stream b's chunk is its first
        valid_b frames (the rest pad it: any codes), only the first spf valid_b samples of its output are
        its own, and its state advances as a chunk of valid_b frames would (0: not at all). Shapes depend on B and T only, positions stay on the
        device and nothing is read back to the host: capture one CUDA graph per chunk size T with static
        `codes` and `state` buffers.
        """
        x = self.pre_transformer.step(self.embed(codes), state).transpose(1, 2)  # [B, H, T]
        for up, convnext in self.upsample:
            x = convnext.step(up.step(x, state), state)  # [B, H, T * prod(ratios)]
        for layer in self.decoder:
            x = layer.step(x, state)
        state.pos.add_(codes.shape[-1] if state.valid is None else state.valid)
        return x.clamp(-1.0, 1.0)
