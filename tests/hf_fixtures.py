"""Reference models and Hugging Face checkpoints for parity tests (transformers' qwen3_omni_moe).

    ref = make_reference(SMALL_CONFIGS["tiny"], seed=0)     # fp32, eval, seeded
    ckpt = save_checkpoint(ref, tmp_path / "ckpt")          # sharded safetensors + index + config.json

Initialisation. transformers initialises every Linear/Embedding with N(0, 0.02). At the small widths
used here (hidden 32-96) that makes every decoder layer a small perturbation of the residual stream:
the logits are then almost a function of the current token alone, so a parity test would barely
exercise attention, rotary positions or MoE routing (router logits of std ~0.1 route near-uniformly).
`make_reference` therefore re-draws every weight matrix, embedding and conv kernel as
N(0, GAIN / sqrt(fan_in)) (fan_in = in_features, or in_channels/groups · kernel for convs; for packed
experts the input width of each expert), so each layer changes the hidden state by O(1), router logits
have std ~GAIN and top-k routing is clearly decided. Code2Wav's last conv is then rescaled so the
waveform has std WAV_STD and is rarely clamped (see `_calibrate_code2wav_`). Vectors (norm weights, biases, SnakeBeta alpha/beta,
layer scales, ConvNeXt gamma) keep transformers' init (ones / zeros / layer_scale_initial_scale), which
keeps Code2Wav's residual branches as the model defines them. GAIN = 1 keeps activations O(1) through
the few layers of these configs. `check_varied(ref)` asserts what this buys: the Thinker's greedy
continuation is not one token repeated, and the Talker makes several frames before codec EOS.

Expert names on disk. transformers 5.17 stores experts packed in memory (`mlp.experts.gate_up_proj`
[E, 2I, H], `mlp.experts.down_proj` [E, H, I]) but `save_pretrained` converts them back to the published
checkpoint's per-expert names: `...mlp.experts.{e}.gate_proj.weight` [I, H], `...up_proj.weight` [I, H],
`...down_proj.weight` [H, I]. So a saved small checkpoint has exactly the layout of the real one.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from omni_rt.model.config import OmniConfig, preset

GAIN = 1.0
WAV_STD = 0.25  # Code2Wav output std after calibration: 4 sigma to the clamp at +-1


def _small_configs() -> dict[str, OmniConfig]:
    # The depths the parity tests were written against (the tiny preset's until 2026-12-01, when the
    # preset was cut to one layer per stage to play in real time on 2 cores): 4 Thinker layers with the
    # Talker reading layer 2, 2 Talker and 2 code-predictor layers; and the real 16 code groups (the
    # preset's until 2026-12-01 night, when it was cut to 4). Every config below derives from these.
    preset_tiny = preset("tiny")
    tiny = replace(
        preset_tiny,
        num_code_groups=16,
        code2wav=replace(preset_tiny.code2wav, num_quantizers=16),
        thinker=replace(preset_tiny.thinker, num_hidden_layers=4),
        talker=replace(preset_tiny.talker, num_hidden_layers=2),
        code_predictor=replace(preset_tiny.code_predictor, num_hidden_layers=2),
        accept_hidden_layer=2,
    )
    # "wide": wider than tiny, shallow, few experts with top-1 routing (no renormalisation effect).
    wide = replace(
        tiny,
        thinker=replace(
            tiny.thinker,
            hidden_size=96,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=16,
            num_hidden_layers=2,
            num_experts=4,
            num_experts_per_tok=1,
            moe_intermediate_size=48,
        ),
        talker=replace(
            tiny.talker,
            hidden_size=48,
            num_attention_heads=3,
            num_key_value_heads=1,
            head_dim=16,
            num_hidden_layers=1,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=32,
        ),
        code_predictor=replace(
            tiny.code_predictor,
            hidden_size=48,
            num_attention_heads=3,
            num_key_value_heads=3,
            head_dim=16,
            num_hidden_layers=1,
            intermediate_size=64,
        ),
        code2wav=replace(
            tiny.code2wav, hidden_size=48, num_attention_heads=3, num_key_value_heads=3, decoder_dim=48
        ),
        accept_hidden_layer=1,
    )
    # "deep": more layers, more experts, larger head_dim (M-RoPE sections of 16), GQA 4:1.
    # its audio encoder must project to the Thinker's width, or speech input would not fit
    wide = replace(wide, audio_config={**tiny.audio_config, "output_dim": wide.thinker.hidden_size})
    deep = replace(
        tiny,
        thinker=replace(
            tiny.thinker,
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=32,
            num_hidden_layers=6,
            num_experts=16,
            num_experts_per_tok=4,
            moe_intermediate_size=16,
            mrope_section=(8, 4, 4),
        ),
        talker=replace(
            tiny.talker,
            num_hidden_layers=3,
            num_experts=16,
            num_experts_per_tok=4,
            moe_intermediate_size=16,
            head_dim=32,
            num_attention_heads=2,
            num_key_value_heads=1,
            mrope_section=(8, 4, 4),
        ),
        code_predictor=replace(tiny.code_predictor, num_hidden_layers=3),
        code2wav=replace(tiny.code2wav, num_hidden_layers=3),
        accept_hidden_layer=4,
    )
    # "narrow": hidden 32, one KV head everywhere, 2 experts top-2 (every token uses all experts).
    narrow = replace(
        tiny,
        thinker=replace(
            tiny.thinker,
            hidden_size=32,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            num_hidden_layers=3,
            num_experts=2,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
        ),
        talker=replace(
            tiny.talker,
            hidden_size=32,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            num_experts=2,
            num_experts_per_tok=1,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
        ),
        code_predictor=replace(
            tiny.code_predictor, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16
        ),
        code2wav=replace(
            tiny.code2wav,
            hidden_size=32,
            num_attention_heads=2,
            num_key_value_heads=2,
            num_hidden_layers=1,
            intermediate_size=64,
            decoder_dim=32,
        ),
        accept_hidden_layer=3,
    )
    out = {"tiny": tiny, "wide": wide, "deep": deep, "narrow": narrow}
    for cfg in out.values():
        cfg.validate()
    return out


SMALL_CONFIGS: dict[str, OmniConfig] = _small_configs()


def hf_config(cfg: OmniConfig):
    """transformers' `Qwen3OmniMoeConfig` for `cfg` (fp32, eager attention so CPU math is plain)."""
    from transformers import Qwen3OmniMoeConfig

    hf = Qwen3OmniMoeConfig(**cfg.to_hf())
    hf._attn_implementation = "eager"
    return hf


def _fan_in(name: str, p: torch.Tensor) -> int:
    if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
        return p.shape[-1]  # [E, out, in]: each expert is a Linear of in-width p.shape[-1]
    if p.dim() == 2:
        return p.shape[1]  # Linear [out, in]; Embedding [V, H] -> rows of norm ~GAIN
    return math.prod(p.shape[1:])  # conv [out, in/groups, k] (transposed convs: [in, out, k], close enough)


@torch.no_grad()
def reinit_(model: nn.Module, seed: int, gain: float = GAIN) -> None:
    """Re-draw every matrix/kernel of `model` as N(0, gain/sqrt(fan_in)); vectors keep their init."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() < 2:
            continue
        std = gain / math.sqrt(_fan_in(name, p))
        p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * std)


def make_reference(cfg: OmniConfig, seed: int, gain: float = GAIN):
    """transformers' `Qwen3OmniMoeForConditionalGeneration` at `cfg`'s shapes, fp32, eval, seeded."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen3OmniMoeForConditionalGeneration(hf_config(cfg))
    reinit_(model, seed, gain)
    model = model.float().eval()
    _calibrate_code2wav_(model.code2wav, seed)
    return model


@torch.no_grad()
def _calibrate_code2wav_(code2wav: nn.Module, seed: int, target_std: float = WAV_STD) -> None:
    """Scale Code2Wav's last conv so the waveform before its [-1, 1] clamp has std `target_std`.

    With fan-in init the decoder's output has std of order 1-100 and ~90% of samples hit the clamp,
    which would hide most of the waveform from parity tests. One seeded calibration decode fixes that.
    """
    g = torch.Generator().manual_seed(seed + 1)
    codes = torch.randint(
        0, code2wav.config.codebook_size, (1, code2wav.config.num_quantizers, 8), generator=g
    )
    last = code2wav.decoder[-1]
    seen: list[torch.Tensor] = []
    handle = last.register_forward_hook(lambda mod, inp, out: seen.append(out))
    try:
        code2wav(codes)
    finally:
        handle.remove()
    scale = target_std / seen[0].std().item()
    for p in last.parameters():
        p.mul_(scale)


def save_checkpoint(ref_model, directory: str | Path, max_shard_size: str | int = "8MB") -> Path:
    """`save_pretrained` into `directory`, sharded into several safetensors files with an index."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ref_model.save_pretrained(directory, max_shard_size=max_shard_size)
    return directory


def text_prompt(cfg: OmniConfig, text_ids: list[int]) -> list[int]:
    """A one-turn chat prompt in ids: `[im_start, user, \\n, …text…, im_end, \\n, im_start, assistant, \\n]`."""
    i = cfg.ids
    return [i.im_start, i.user, i.newline, *text_ids, i.im_end, i.newline, i.im_start, i.assistant, i.newline]


@torch.no_grad()
def reference_generate(ref, cfg: OmniConfig, prompt: list[int], max_tokens: int = 8, max_frames: int = 12):
    """Greedy reference generate with audio: (new text ids, codes [16, frames], Talker ids, wav [S])."""
    input_ids = torch.tensor([prompt])
    talker_result: dict = {}
    orig = ref.talker.generate

    def capture(*args, **kwargs):  # keep the Talker's sequences to read its frames and EOS
        out = orig(*args, **kwargs)
        talker_result["out"] = out
        return out

    ref.talker.generate = capture
    try:
        seqs, wav = ref.generate(
            input_ids=input_ids,
            speaker="ethan",
            thinker_max_new_tokens=max_tokens,
            thinker_do_sample=False,
            talker_do_sample=False,
            talker_max_new_tokens=max_frames,
            return_audio=True,
        )
    finally:
        del ref.talker.generate
    out = talker_result["out"]
    codes = torch.stack([h[-1] for h in out.hidden_states if h[-1] is not None], dim=1)  # [1, frames, 16]
    return seqs[0, len(prompt) :].tolist(), codes[0].T, out.sequences[0].tolist(), wav.reshape(-1)


def check_varied(ref, cfg: OmniConfig, max_tokens: int = 6, max_frames: int = 6) -> dict:
    """Assert that greedy outputs of `ref` are varied (the point of the init above); return them."""
    prompt = text_prompt(cfg, [9707, 11, 1879, 0, 2585, 525, 498, 30])  # "Hello, world! How are you?"
    text, codes, talker_seq, wav = reference_generate(ref, cfg, prompt, max_tokens, max_frames)
    assert len(set(text)) > 2, f"Thinker greedy output barely varies: {text}"
    frames = codes.shape[1]
    assert frames >= 3, f"Talker made only {frames} frames before EOS: {talker_seq}"
    assert len({tuple(c) for c in codes.T.tolist()}) > 1, "Talker frames all identical"
    assert torch.isfinite(wav).all() and wav.abs().max() > 0
    return {"text": text, "codes": codes, "talker_seq": talker_seq, "wav": wav}
