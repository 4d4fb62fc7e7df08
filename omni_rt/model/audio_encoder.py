"""The Thinker's audio encoder (`thinker.audio_tower.*`): 128-bin log-mel frames -> Thinker-width tokens.

    enc = OmniModel.build(cfg, ...).thinker.audio_tower       # loaded and initialised with the model
    tokens = enc.encode(log_mel(audio))                       # [128, T] -> [audio_token_count(T), 2048]
    tokens = enc(features, feature_lens)                      # several clips: [128, sum(T)], [N] -> [sum, 2048]

Architecture (Whisper-like, windowed), parameter names as in the checkpoint under `thinker.audio_tower.`:
  1. each clip's frames are cut into windows of 2·n_window (100 frames = 1 s); all windows of the batch
     are zero-padded to the longest and go through three 3x3 stride-2 Conv2d + GELU over (mel, time)
     (`conv2d1..3`), so 100 frames -> 13 steps and 128 bins -> 16; `conv_out` flattens (channel, bin) to
     d_model; each window gets sinusoidal positions from 0 (`positional_embedding`, not in the checkpoint);
  2. the valid steps of every window are packed into one token sequence per clip; pre-LayerNorm encoder
     layers then attend bidirectionally inside blocks of n_window_infer / (2·n_window) windows (8 s of
     audio at the real config) and never across clips;
  3. `ln_post`, `proj1`, GELU, `proj2` to the Thinker's width (`output_dim`).
Padding the last window like the others matters: the padded zeros go through the conv biases and GELU,
so its boundary steps differ slightly from an unpadded conv; the reference pads the same way.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from omni_rt.audio.features import audio_token_count
from omni_rt.errors import ConfigError, InvalidRequestError
from omni_rt.model.device_ids import to_device

CHECKPOINT_PREFIX = "thinker.audio_tower."


@dataclass(frozen=True)
class AudioEncoderConfig:
    """The checkpoint's `thinker_config.audio_config` (defaults: the released Qwen3-Omni-30B-A3B's)."""

    num_mel_bins: int = 128
    d_model: int = 1280
    encoder_layers: int = 32
    encoder_attention_heads: int = 20
    encoder_ffn_dim: int = 5120
    downsample_hidden_size: int = 480
    output_dim: int = 2048
    n_window: int = 50  # conv windows of 2·n_window mel frames
    n_window_infer: int = 800  # attention blocks of n_window_infer mel frames
    max_source_positions: int = 1500  # rows of the sinusoidal table (steps per conv window)
    activation_function: str = "gelu"

    @classmethod
    def from_hf(cls, d: Mapping[str, Any]) -> AudioEncoderConfig:
        known = {f.name for f in fields(cls)}
        cfg = cls(**{k: v for k, v in d.items() if k in known})
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.activation_function != "gelu":
            raise ConfigError(
                f"audio encoder activation {self.activation_function!r}: only 'gelu' is supported"
            )
        if self.d_model % self.encoder_attention_heads or self.d_model % 2:
            raise ConfigError(
                f"audio d_model {self.d_model} must be even and divisible by {self.encoder_attention_heads} heads"
            )
        if self.n_window <= 0 or self.n_window_infer < 2 * self.n_window:
            raise ConfigError(
                f"audio n_window {self.n_window} / n_window_infer {self.n_window_infer}: need "
                "n_window > 0 and n_window_infer >= 2 * n_window"
            )
        if conv_steps(2 * self.n_window) > self.max_source_positions:
            raise ConfigError("audio max_source_positions is shorter than one conv window's steps")

    @property
    def conv_bins(self) -> int:
        """Mel bins left after the three stride-2 convs (128 -> 16)."""
        return conv_steps(self.num_mel_bins)


def conv_steps(n: int) -> int:
    """Length after three 3-tap stride-2 convs with padding 1: ceil(ceil(ceil(n / 2) / 2) / 2)."""
    for _ in range(3):
        n = (n + 1) // 2
    return n


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """[length, channels]: sin of position / timescale in the first half, cos in the second (fp32)."""
    step = math.log(max_timescale) / (channels // 2 - 1)
    inv = torch.exp(-step * torch.arange(channels // 2, dtype=torch.float32))  # [C/2]
    t = torch.arange(length, dtype=torch.float32)[:, None] * inv[None]  # [L, C/2]
    return torch.cat((t.sin(), t.cos()), dim=1)


class AudioAttention(nn.Module):
    """Bidirectional multi-head attention with biases (`self_attn.{q,k,v,out}_proj`)."""

    def __init__(self, cfg: AudioEncoderConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.heads = cfg.encoder_attention_heads
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, key_ok: torch.Tensor) -> torch.Tensor:
        """x [W, L, d] (blocks of tokens), key_ok [W, L] (real tokens) -> [W, L, d]."""
        w, n, d = x.shape

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(w, n, self.heads, d // self.heads).transpose(1, 2)  # [W, heads, L, hd]

        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=key_ok[:, None, None, :])  # [W, heads, L, hd]
        return self.out_proj(o.transpose(1, 2).reshape(w, n, d))


class AudioEncoderLayer(nn.Module):
    """Pre-LayerNorm block: x + attn(ln(x)), then x + fc2(gelu(fc1(ln(x))))."""

    def __init__(self, cfg: AudioEncoderConfig) -> None:
        super().__init__()
        self.self_attn = AudioAttention(cfg)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.d_model)
        self.fc1 = nn.Linear(cfg.d_model, cfg.encoder_ffn_dim)
        self.fc2 = nn.Linear(cfg.encoder_ffn_dim, cfg.d_model)
        self.final_layer_norm = nn.LayerNorm(cfg.d_model)

    def forward(self, x: torch.Tensor, key_ok: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), key_ok)
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class AudioEncoder(nn.Module):
    """`thinker.audio_tower`: log-mel frames of one or more clips -> tokens [N_tokens, output_dim]."""

    def __init__(self, cfg: AudioEncoderConfig | Mapping[str, Any]) -> None:
        super().__init__()
        if not isinstance(cfg, AudioEncoderConfig):
            cfg = AudioEncoderConfig.from_hf(cfg)
        cfg.validate()
        self.cfg = cfg
        ch = cfg.downsample_hidden_size
        self.conv2d1 = nn.Conv2d(1, ch, 3, 2, padding=1)
        self.conv2d2 = nn.Conv2d(ch, ch, 3, 2, padding=1)
        self.conv2d3 = nn.Conv2d(ch, ch, 3, 2, padding=1)
        self.conv_out = nn.Linear(ch * cfg.conv_bins, cfg.d_model, bias=False)
        # a computed table, not a checkpoint tensor (non-persistent, like the reference's)
        self.register_buffer(
            "positional_embedding", sinusoids(cfg.max_source_positions, cfg.d_model), persistent=False
        )
        self.layers = nn.ModuleList(AudioEncoderLayer(cfg) for _ in range(cfg.encoder_layers))
        self.ln_post = nn.LayerNorm(cfg.d_model)
        self.proj1 = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj2 = nn.Linear(cfg.d_model, cfg.output_dim)

    def encode(self, features: torch.Tensor) -> torch.Tensor:
        """One clip: features [n_mels, T] -> [audio_token_count(T), output_dim]."""
        if features.dim() != 2:
            raise InvalidRequestError(f"features must be [n_mels, T], got {tuple(features.shape)}")
        return self(features, torch.tensor([features.shape[1]]))

    def forward(self, features: torch.Tensor, feature_lens: torch.Tensor) -> torch.Tensor:
        """features [n_mels, sum(feature_lens)] (clips concatenated in time), feature_lens [N] ->
        tokens [sum(audio_token_count(feature_lens)), output_dim], clip after clip.

        The reference's `Qwen3OmniMoeAudioEncoder.forward(input_features, feature_lens)` contract. Lengths
        are read on the host (one sync on a GPU): window layout is plain Python.
        """
        lens = self._check(features, feature_lens)
        cfg = self.cfg
        win = 2 * cfg.n_window

        # 1.-2. conv windows of every clip, zero-padded to the longest window, valid steps packed
        chunk_lens = [min(win, n - s) for n in lens for s in range(0, n, win)]
        tokens = self.conv_tokens(list(features.T.split(chunk_lens, dim=0)))

        # 3. attention blocks: n_window_infer / win conv windows' worth of steps, never across clips
        block = self.block_tokens(max(chunk_lens))
        sizes = []
        for n in lens:
            t = int(audio_token_count(n, cfg.n_window))
            sizes += [block] * (t // block) + ([t % block] if t % block else [])
        return self.attend(tokens, sizes)

    def block_tokens(self, longest_window: int) -> int:
        """Tokens in one attention block, when the batch's longest conv window has that many frames."""
        return conv_steps(longest_window) * (self.cfg.n_window_infer // (2 * self.cfg.n_window))

    def conv_tokens(self, chunks: list[torch.Tensor], pad_to: int = 0) -> torch.Tensor:
        """Conv windows chunks[i] [len_i, n_mels] (time first) -> their valid steps [sum, d_model].

        Windows are zero-padded to the longest of them (or `pad_to`): what a window's boundary steps
        are depends on it, so a window encoded alone (a turn as it arrives) is padded as the whole
        clip's batch would pad it.
        """
        lens = [c.shape[0] for c in chunks]
        width = max(max(lens), pad_to)
        x = chunks[0].new_zeros(len(chunks), width, chunks[0].shape[1])
        for i, c in enumerate(chunks):
            x[i, : lens[i]] = c
        x = x.transpose(1, 2).unsqueeze(1).to(self.conv2d1.weight.dtype)  # [C, 1, M, Lw]
        x = F.gelu(self.conv2d1(x))
        x = F.gelu(self.conv2d2(x))
        x = F.gelu(self.conv2d3(x))  # [C, ch, M', L']
        c, ch, m, steps = x.shape
        x = self.conv_out(x.permute(0, 3, 1, 2).reshape(c, steps, ch * m))  # [C, L', d]
        x = x + self.positional_embedding[:steps].to(x.dtype)  # positions restart in every window
        valid = [conv_steps(n) for n in lens]
        keep = torch.arange(steps)[None] < torch.tensor(valid)[:, None]  # [C, L']
        return x.reshape(c * steps, -1)[
            to_device(keep.flatten().nonzero().squeeze(1), x.device)
        ]  # no host sync

    def attend(self, tokens: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Conv tokens [N, d_model] in attention blocks of `sizes` (consecutive runs) -> [N, output_dim]."""
        x, ok = self._blocks(tokens, sizes)  # [W, block, d], real tokens [W, block]
        for layer in self.layers:
            x = layer(x, ok)
        x = x[ok]  # [N_tok, d], back in token order
        return self.proj2(F.gelu(self.proj1(self.ln_post(x))))

    @staticmethod
    def _blocks(tokens: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Pack consecutive token runs of `sizes` into zero-padded rows: ([W, block, d], ok [W, block])."""
        rows = tokens.split(sizes, dim=0)
        width = max(sizes)  # == block unless every clip is shorter than one block
        x = tokens.new_zeros(len(rows), width, tokens.shape[1])
        ok = torch.zeros(len(rows), width, dtype=torch.bool, device=tokens.device)
        for i, r in enumerate(rows):
            x[i, : r.shape[0]] = r
            ok[i, : r.shape[0]] = True
        return x, ok

    def _check(self, features: torch.Tensor, feature_lens: torch.Tensor) -> list[int]:
        m = self.cfg.num_mel_bins
        if features.dim() != 2 or features.shape[0] != m:
            raise InvalidRequestError(
                f"features must be [{m}, T] (mel bins first), got {tuple(features.shape)}"
            )
        if not features.is_floating_point():
            raise InvalidRequestError(f"features must be floating point, got {features.dtype}")
        lens_t = torch.as_tensor(feature_lens)
        if lens_t.dim() != 1 or lens_t.numel() == 0 or lens_t.is_floating_point():
            raise InvalidRequestError(f"feature_lens must be integer [N], N >= 1, got {tuple(lens_t.shape)}")
        lens = [int(n) for n in lens_t.tolist()]
        if min(lens) < 1:
            raise InvalidRequestError(f"every clip needs at least one mel frame, got lengths {lens}")
        if sum(lens) != features.shape[1]:
            raise InvalidRequestError(
                f"feature_lens sum to {sum(lens)}, features have {features.shape[1]} frames"
            )
        return lens
