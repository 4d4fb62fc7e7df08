"""The Thinker's text decoder: embeddings, MoE decoder layers with a static slot KV cache, lm_head.

Parameter names equal the checkpoint's under the `thinker.` prefix (experts packed, see
docs/internals.md): `model.embed_tokens.weight`, `model.layers.{i}.*`, `model.norm.weight`,
`lm_head.weight`. The audio and vision encoders are not part of this module.

    Thinker(cfg: DecoderConfig, moe_impl: str = "auto")
    Thinker.forward(input_ids[B, T] | None, positions[B, T], cache, slots[B], hidden_layer=None,
                    last_only=False, *, inputs_embeds[B, T, H] | None = None,
                    rope_positions[3, B, T] | None = None, logits_index[B] | None = None,
                    kv_len: int | None = None)
        -> (logits [B, T | 1, V], hidden [B, T, H] | None)
    Thinker.embed(ids[B, T]) -> [B, T, H]
    Thinker.layer_inputs / run_layers / logits: forward's parts (a decode step graphed in parts runs them)
    Thinker.allocate_cache(n_slots, max_len, device=None, dtype=None) -> KVCache
"""

from __future__ import annotations

import torch
from torch import nn

from omni_rt.errors import ConfigError, InvalidRequestError
from omni_rt.model.config import DecoderConfig
from omni_rt.model.layers import DecoderLayer, KVCache, RMSNorm, Rotary, attention_mask


class ThinkerTextModel(nn.Module):
    """`model.*` of the checkpoint's Thinker: embed_tokens, layers, norm."""

    def __init__(self, cfg: DecoderConfig, moe_impl: str = "auto") -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, moe_impl) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Thinker(nn.Module):
    def __init__(self, cfg: DecoderConfig, moe_impl: str = "auto") -> None:
        super().__init__()
        if not cfg.is_moe:
            raise ConfigError("the Thinker is a MoE decoder: its config needs num_experts > 0")
        self.cfg = cfg
        self.model = ThinkerTextModel(cfg, moe_impl)
        # interleaved M-RoPE as in the reference (text positions give plain RoPE); holds no tensors
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.mrope_section)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)  # untied from embed_tokens

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Input token embeddings [B, T, H] (the Talker's text path reads these)."""
        return self.model.embed_tokens(ids)

    def allocate_cache(
        self,
        n_slots: int,
        max_len: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> KVCache:
        """A static cache for `n_slots` sequences of up to `max_len` tokens; defaults to the weights'."""
        w = self.lm_head.weight
        return KVCache(
            self.cfg.num_hidden_layers,
            n_slots,
            self.cfg.num_key_value_heads,
            max_len,
            self.cfg.head_dim,
            device=w.device if device is None else device,
            dtype=w.dtype if dtype is None else dtype,
        )

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        cache: KVCache,
        slots: torch.Tensor,
        hidden_layer: int | None = None,
        last_only: bool = False,
        *,
        inputs_embeds: torch.Tensor | None = None,
        rope_positions: torch.Tensor | None = None,
        logits_index: torch.Tensor | None = None,
        kv_len: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run new tokens of B sequences through the decoder, writing their k/v into `cache`.

        positions [B, T]: absolute positions of the new tokens (the cache rows they are written to and the
        causal limit of their queries). rope_positions [3, B, T]: (t, h, w) M-RoPE positions for
        multimodal input; defaults to `positions`. hidden_layer k: also return the reference's
        `hidden_states[k]` (0 = embeddings, k = output of decoder layer k-1; the reference takes its last
        entry, k = num_layers, after the final norm, and so does this). last_only: logits of the last
        position only [B, 1, V]; logits_index [B]: logits at that index of each row only (right-padded
        batched prefill), [B, 1, V]. kv_len: attend over cache rows [0, kv_len) only (a static length
        bucket above every position, so a graph per bucket stays cheap at short lengths); default all.
        """
        x = self._check(input_ids, inputs_embeds, positions, cache, slots, hidden_layer, kv_len)
        kv_len = cache.max_len if kv_len is None else kv_len
        cos, sin, mask = self.layer_inputs(
            positions if rope_positions is None else rope_positions, positions, kv_len, x.dtype
        )
        n_layers = len(self.model.layers)
        hidden = x if hidden_layer == 0 else None
        start = 0
        if hidden_layer is not None and 0 < hidden_layer < n_layers:
            hidden = x = self.run_layers(x, cos, sin, mask, cache, slots, positions, kv_len, 0, hidden_layer)
            start = hidden_layer
        x = self.run_layers(x, cos, sin, mask, cache, slots, positions, kv_len, start, n_layers)
        if hidden_layer == n_layers:
            hidden = self.model.norm(x)  # the reference's last hidden_states entry is after the final norm
        return self.logits(x, last_only, logits_index), hidden

    def layer_inputs(
        self, rope_positions: torch.Tensor, positions: torch.Tensor, kv_len: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What every layer reads besides its input: RoPE cos, sin [B, T, D] at `rope_positions` ([B, T], or
        [3, B, T] for M-RoPE), and the causal mask [B, 1, rep*T, kv_len] of `positions` [B, T]."""
        cos, sin = self.rotary(rope_positions, dtype)
        rep = self.cfg.num_attention_heads // self.cfg.num_key_value_heads
        return cos, sin, attention_mask(positions, kv_len, rep)

    def run_layers(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        cache: KVCache,
        slots: torch.Tensor,
        positions: torch.Tensor,
        kv_len: int,
        start: int,
        stop: int,
    ) -> torch.Tensor:
        """Decoder layers [start, stop) on x [B, T, H] (`layer_inputs` gives cos, sin and mask), writing
        their k/v into `cache`: forward's layers, or a part of them (a decode step graphed in parts)."""
        for layer in self.model.layers[start:stop]:
            x = layer(x, cos, sin, cache, slots, positions, kv_len, mask)  # [B, T, H]
        return x

    def logits(
        self, x: torch.Tensor, last_only: bool = False, logits_index: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The last layer's output x [B, T, H] -> logits [B, T, V]; [B, 1, V] of the last position
        (last_only) or of each row's `logits_index` [B]."""
        if logits_index is not None:
            x = x[torch.arange(x.shape[0], device=x.device), logits_index].unsqueeze(1)  # [B, 1, H]
        elif last_only:
            x = x[:, -1:]  # [B, 1, H]
        return self.lm_head(self.model.norm(x))  # norm after slicing: last_only is cheap

    def _check(
        self,
        input_ids: torch.Tensor | None,
        inputs_embeds: torch.Tensor | None,
        positions: torch.Tensor,
        cache: KVCache,
        slots: torch.Tensor,
        hidden_layer: int | None,
        kv_len: int | None,
    ) -> torch.Tensor:
        """Validate shapes (never values on the GPU: that would sync) and return the input embeddings."""
        if (input_ids is None) == (inputs_embeds is None):
            raise InvalidRequestError("give exactly one of input_ids [B, T] or inputs_embeds [B, T, H]")
        if input_ids is not None:
            if input_ids.dim() != 2 or input_ids.shape[1] == 0:
                raise InvalidRequestError(
                    f"input_ids must be [B, T] with T > 0, got {tuple(input_ids.shape)}"
                )
            if input_ids.is_floating_point():
                raise InvalidRequestError(f"input_ids must be integer token ids, got {input_ids.dtype}")
            if input_ids.device.type == "cpu" and (
                input_ids.min() < 0 or input_ids.max() >= self.cfg.vocab_size
            ):
                raise InvalidRequestError(f"token ids must be in [0, {self.cfg.vocab_size})")
            x = self.embed(input_ids)
        else:
            x = inputs_embeds
        cache.check_access(self.cfg, x, positions, slots, kv_len, "Thinker")
        if hidden_layer is not None and not 0 <= hidden_layer <= self.cfg.num_hidden_layers:
            raise InvalidRequestError(
                f"hidden_layer {hidden_layer} outside 0..{self.cfg.num_hidden_layers} (hidden_states index)"
            )
        return x
