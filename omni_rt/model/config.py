"""Model shapes of Qwen3-Omni, read from a Hugging Face `config.json` (or a preset).

Frozen dataclasses, no torch: the pipeline and the tests read them without touching tensors.
`OmniConfig.from_hf(d)` takes the checkpoint's nested dict; `to_hf()` writes one back that the
reference implementation (transformers' `Qwen3OmniMoeConfig(**d)`) instantiates to the same shapes,
including the fields its config classes forget to declare (see shared/reference/qwen3-omni.md).
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class DecoderConfig:
    """A text decoder: the Thinker's, the Talker's (MoE) or the code predictor's (dense)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    intermediate_size: int  # dense FFN width (code predictor; unused by all-MoE decoders)
    # MoE (num_experts == 0: a dense decoder)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0  # Talker: one sigmoid-gated shared expert
    # interleaved multimodal RoPE: sections of head_dim/2 for (t, h, w); text uses t == h == w
    mrope_section: tuple[int, ...] = ()
    mrope_interleaved: bool = False
    use_qk_norm: bool = True

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> DecoderConfig:
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        heads = d["num_attention_heads"]
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads", heads),
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=d.get("max_position_embeddings", 32768),
            intermediate_size=d.get("intermediate_size", 0),
            # transformers' save_pretrained writes the Talker's count as num_local_experts, num_experts null
            num_experts=d.get("num_experts") or d.get("num_local_experts") or 0,
            num_experts_per_tok=d.get("num_experts_per_tok", 0),
            moe_intermediate_size=d.get("moe_intermediate_size", 0),
            norm_topk_prob=d.get("norm_topk_prob", True),
            shared_expert_intermediate_size=d.get("shared_expert_intermediate_size", 0) or 0,
            mrope_section=tuple(rope.get("mrope_section", ())),
            mrope_interleaved=bool(rope.get("interleaved", rope.get("mrope_interleaved", False))),
        )

    def to_hf(self) -> dict[str, Any]:
        rope: dict[str, Any] = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.mrope_section:
            rope["mrope_section"] = list(self.mrope_section)
            rope["interleaved"] = self.mrope_interleaved
            rope["mrope_interleaved"] = self.mrope_interleaved
        d: dict[str, Any] = {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope,
            "max_position_embeddings": self.max_position_embeddings,
            "intermediate_size": self.intermediate_size,
            "hidden_act": "silu",
            "sliding_window": None,
        }
        if self.is_moe:
            d.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                shared_expert_intermediate_size=self.shared_expert_intermediate_size,
                decoder_sparse_step=1,
                mlp_only_layers=[],
            )
        return d


@dataclass(frozen=True)
class Code2WavConfig:
    codebook_size: int
    num_quantizers: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    sliding_window: int
    rope_theta: float
    rms_norm_eps: float
    layer_scale_initial_scale: float
    max_position_embeddings: int
    decoder_dim: int
    upsample_rates: tuple[int, ...]
    upsampling_ratios: tuple[int, ...]

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def samples_per_frame(self) -> int:
        """PCM samples per codec frame (1920 for the real model: 24 kHz at 12.5 frames/s)."""
        n = 1
        for r in (*self.upsampling_ratios, *self.upsample_rates):
            n *= r
        return n

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> Code2WavConfig:
        rope = d.get("rope_parameters") or {}
        return cls(
            codebook_size=d["codebook_size"],
            num_quantizers=d["num_quantizers"],
            hidden_size=d["hidden_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads", d["num_attention_heads"]),
            intermediate_size=d["intermediate_size"],
            sliding_window=d["sliding_window"],
            rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
            rms_norm_eps=d.get("rms_norm_eps", 1e-5),
            layer_scale_initial_scale=d.get("layer_scale_initial_scale", 0.01),
            max_position_embeddings=d.get("max_position_embeddings", 8000),
            decoder_dim=d["decoder_dim"],
            upsample_rates=tuple(d["upsample_rates"]),
            upsampling_ratios=tuple(d["upsampling_ratios"]),
        )

    def to_hf(self) -> dict[str, Any]:
        return {
            "codebook_size": self.codebook_size,
            "num_quantizers": self.num_quantizers,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "intermediate_size": self.intermediate_size,
            "sliding_window": self.sliding_window,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "rms_norm_eps": self.rms_norm_eps,
            "layer_scale_initial_scale": self.layer_scale_initial_scale,
            "max_position_embeddings": self.max_position_embeddings,
            "decoder_dim": self.decoder_dim,
            "upsample_rates": list(self.upsample_rates),
            "upsampling_ratios": list(self.upsampling_ratios),
            "hidden_act": "silu",
            "codebook_dim": 512,
            "num_semantic_quantizers": 1,
            "semantic_codebook_size": 4096,
            "vector_quantization_hidden_dimension": 512,
        }


@dataclass(frozen=True)
class TokenIds:
    """Special token ids of the Thinker's vocabulary and the Talker's codec vocabulary."""

    im_start: int = 151644
    im_end: int = 151645
    system: int = 8948
    user: int = 872
    assistant: int = 77091
    newline: int = 198
    tts_pad: int = 151671
    tts_bos: int = 151672
    tts_eos: int = 151673
    audio_start: int = 151669
    audio_end: int = 151670
    audio: int = 151675
    image: int = 151655
    video: int = 151656
    codec_pad: int = 2148
    codec_bos: int = 2149
    codec_eos: int = 2150
    codec_nothink: int = 2155
    codec_think_bos: int = 2156
    codec_think_eos: int = 2157


@dataclass(frozen=True)
class OmniConfig:
    thinker: DecoderConfig
    talker: DecoderConfig
    code_predictor: DecoderConfig
    code2wav: Code2WavConfig
    ids: TokenIds = field(default_factory=TokenIds)
    speakers: dict[str, int] = field(default_factory=lambda: {"chelsie": 2301, "ethan": 2302, "aiden": 2303})
    num_code_groups: int = 16
    accept_hidden_layer: int = 24  # Talker reads Thinker hidden_states[24] at multimodal positions
    # the audio encoder's config (thinker.audio_tower), verbatim
    audio_config: dict[str, Any] = field(default_factory=dict)

    def __hash__(self) -> int:  # dict field: hash by identity of the shapes that matter
        return hash((self.thinker, self.talker, self.code_predictor, self.code2wav, self.ids))

    def speaker_id(self, voice: str) -> int:
        """The codec id of a voice (case-insensitive); KeyError names the known voices."""
        try:
            return self.speakers[voice.lower()]
        except KeyError:
            raise KeyError(f"unknown voice {voice!r}; known voices: {sorted(self.speakers)}") from None

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> OmniConfig:
        th = d["thinker_config"]
        tk = d["talker_config"]
        ids = TokenIds(
            im_start=d.get("im_start_token_id", 151644),
            im_end=d.get("im_end_token_id", 151645),
            system=d.get("system_token_id", 8948),
            user=d.get("user_token_id", 872),
            assistant=d.get("assistant_token_id", 77091),
            tts_pad=d.get("tts_pad_token_id", 151671),
            tts_bos=d.get("tts_bos_token_id", 151672),
            tts_eos=d.get("tts_eos_token_id", 151673),
            audio_start=th.get("audio_start_token_id", 151669),
            audio_end=th.get("audio_end_token_id", 151670),
            audio=th.get("audio_token_id", 151675),
            image=th.get("image_token_id", 151655),
            video=th.get("video_token_id", 151656),
            codec_pad=tk.get("codec_pad_id", 2148),
            codec_bos=tk.get("codec_bos_id", 2149),
            codec_eos=tk.get("codec_eos_token_id", 2150),
            codec_nothink=tk.get("codec_nothink_id", 2155),
            codec_think_bos=tk.get("codec_think_bos_id", 2156),
            codec_think_eos=tk.get("codec_think_eos_id", 2157),
        )
        cfg = cls(
            thinker=DecoderConfig.from_hf(th["text_config"]),
            talker=DecoderConfig.from_hf(tk["text_config"]),
            code_predictor=DecoderConfig.from_hf(tk["code_predictor_config"]),
            code2wav=Code2WavConfig.from_hf(d["code2wav_config"]),
            ids=ids,
            speakers={k.lower(): int(v) for k, v in (tk.get("speaker_id") or {}).items()}
            or {"chelsie": 2301, "ethan": 2302, "aiden": 2303},
            num_code_groups=tk.get("num_code_groups", 16),
            accept_hidden_layer=tk.get("accept_hidden_layer", 24),
            audio_config=dict(th.get("audio_config") or {}),
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        groups = {self.num_code_groups, self.code2wav.num_quantizers}
        if len(groups) != 1:
            raise ValueError(
                f"talker num_code_groups ({self.num_code_groups}) must equal code2wav num_quantizers "
                f"({self.code2wav.num_quantizers})"
            )
        if not 0 < self.accept_hidden_layer <= self.thinker.num_hidden_layers:
            raise ValueError(
                f"accept_hidden_layer {self.accept_hidden_layer} outside the Thinker's "
                f"{self.thinker.num_hidden_layers} layers"
            )

    def to_hf(self) -> dict[str, Any]:
        """A config dict that both `from_hf` and transformers' `Qwen3OmniMoeConfig(**d)` accept."""
        i = self.ids
        thinker_text = self.thinker.to_hf() | {"use_qk_norm": True}
        thinker_text["rope_parameters"]["mrope_interleaved"] = self.thinker.mrope_interleaved
        mm_ids = {
            "audio_start_token_id": i.audio_start,
            "audio_end_token_id": i.audio_end,
            "audio_token_id": i.audio,
            "image_token_id": i.image,
            "video_token_id": i.video,
            "vision_start_token_id": 151652,
            "position_id_per_seconds": 13,
            "seconds_per_chunk": 2,
        }
        audio = copy.deepcopy(self.audio_config) or _small_audio_config(self.thinker.hidden_size)
        vision = {
            "depth": 1,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": self.thinker.hidden_size,
            "deepstack_visual_indexes": [0],
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_channels": 3,
            "num_position_embeddings": 64,
        }
        return {
            "architectures": ["Qwen3OmniMoeForConditionalGeneration"],
            "model_type": "qwen3_omni_moe",
            "enable_audio_output": True,
            "im_start_token_id": i.im_start,
            "im_end_token_id": i.im_end,
            "system_token_id": i.system,
            "user_token_id": i.user,
            "assistant_token_id": i.assistant,
            "tts_pad_token_id": i.tts_pad,
            "tts_bos_token_id": i.tts_bos,
            "tts_eos_token_id": i.tts_eos,
            "thinker_config": {
                **mm_ids,
                "vision_end_token_id": 151653,
                "user_token_id": i.user,
                "text_config": thinker_text,
                "audio_config": audio,
                "vision_config": vision,
            },
            "talker_config": {
                **mm_ids,
                "codec_bos_id": i.codec_bos,
                "codec_eos_token_id": i.codec_eos,
                "codec_pad_id": i.codec_pad,
                "codec_nothink_id": i.codec_nothink,
                "codec_think_bos_id": i.codec_think_bos,
                "codec_think_eos_id": i.codec_think_eos,
                "num_code_groups": self.num_code_groups,
                "accept_hidden_layer": self.accept_hidden_layer,
                "thinker_hidden_size": self.thinker.hidden_size,
                "spatial_merge_size": 2,
                "speaker_id": dict(self.speakers),
                "text_config": self.talker.to_hf(),
                "code_predictor_config": self.code_predictor.to_hf()
                | {"num_code_groups": self.num_code_groups},
            },
            "code2wav_config": self.code2wav.to_hf(),
        }

    def with_shapes(self, **changes: Any) -> OmniConfig:
        """A copy with some sub-configs replaced: `cfg.with_shapes(thinker=replace(cfg.thinker, ...))`."""
        return replace(self, **changes)

    def describe(self) -> dict[str, Any]:
        return asdict(self)


PRESETS = ("tiny", "qwen3-omni-30b-a3b")


def _tiny() -> OmniConfig:
    """Real vocabularies, special ids and Code2Wav upsampling; small everything else, 4 code groups.

    Depths are the least that exercise every code path (a Thinker layer before the one the Talker reads,
    one Talker and one code-predictor layer): on a CPU a step is dominated by per-op dispatch, not FLOPs,
    so each layer cut is a share of the budget the embedded default must stay within to play in real time
    on 2 cores (docs/performance.md, 2026-12-01). For the same reason 4 code groups, not the real 16: the
    code predictor steps once per group after code 0, and its 15 steps a frame were ~80 % of the Talker
    thread's CPU and ~40 % of the pipeline's in the served process; 3 steps still run its prefill and
    its cached single steps (2026-12-01 night). Parity tests pin shapes of their own, 16 groups included
    (tests/hf_fixtures.py)."""
    real = OmniConfig.from_hf(json.loads(_preset_text("qwen3-omni-30b-a3b")))
    small = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    return replace(
        real,
        num_code_groups=4,
        thinker=replace(
            real.thinker,
            **small,
            num_hidden_layers=2,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            intermediate_size=32,
            mrope_section=(4, 2, 2),
        ),
        talker=replace(
            real.talker,
            **small,
            num_hidden_layers=1,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            intermediate_size=64,
            mrope_section=(4, 2, 2),
        ),
        code_predictor=replace(real.code_predictor, **small, num_hidden_layers=1, intermediate_size=128),
        code2wav=replace(
            real.code2wav,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            intermediate_size=128,
            decoder_dim=64,
            num_quantizers=4,
        ),
        accept_hidden_layer=1,
        audio_config=_small_audio_config(64),
    )


def _small_audio_config(output_dim: int) -> dict[str, Any]:
    """A minimal audio-encoder config for small presets and test checkpoints (speech input at toy widths)."""
    return {
        "d_model": 32,
        "encoder_attention_heads": 2,
        "encoder_ffn_dim": 64,
        "encoder_layers": 1,
        "num_mel_bins": 128,
        "output_dim": output_dim,
        "downsample_hidden_size": 16,
        "n_window": 50,
        "n_window_infer": 800,
        "max_source_positions": 1500,
    }


def _preset_text(name: str) -> str:
    return resources.files("omni_rt.presets").joinpath(f"{name}.json").read_text()


def preset(name: str) -> OmniConfig:
    """The model config of a named preset: `tiny` or `qwen3-omni-30b-a3b`."""
    if name == "tiny":
        return _tiny()
    if name in PRESETS:
        return OmniConfig.from_hf(json.loads(_preset_text(name)))
    raise KeyError(f"unknown preset {name!r}; presets: {list(PRESETS)}")


def load_hf_config(path: str | Path) -> OmniConfig:
    """The config of a Hugging Face checkpoint directory (its `config.json`); ConfigError if unusable."""
    from omni_rt.errors import ConfigError

    p = Path(path)
    f = p / "config.json" if p.is_dir() else p
    if not f.is_file():
        raise ConfigError(f"no config.json at {p}")
    try:
        d = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{f}: not JSON ({e})") from None
    try:
        return OmniConfig.from_hf(d)
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{f}: not a Qwen3-Omni config ({type(e).__name__}: {e})") from e
