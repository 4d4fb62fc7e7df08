"""OmniModel: the three stages of Qwen3-Omni's speech pipeline under the checkpoint's top-level names.

    model = OmniModel.build(cfg, device="cuda", dtype=torch.bfloat16, weights="/models/Qwen3-Omni")
    model.thinker   # Thinker(cfg.thinker)   checkpoint names thinker.*  (vision encoder skipped)
    model.thinker.audio_tower  # AudioEncoder(cfg.audio_config)   thinker.audio_tower.*  (when configured)
    model.talker    # Talker(cfg)            talker.*  (incl. talker.code_predictor.*)
    model.code2wav  # Code2Wav(cfg.code2wav) code2wav.*

`build` constructs with parameters on the meta device (no memory, no init work), then gives each
parameter storage directly on the target device and dtype and fills it from the checkpoint or from the
seeded random init: at no point are there two copies of the weights. Buffers (small tables a module
computes in its constructor) are built for real on the CPU and moved, so they keep their values.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from torch import nn

from omni_rt.errors import ConfigError
from omni_rt.model.config import OmniConfig, load_hf_config
from omni_rt.model.weights import LoadReport, init_random, load_weights, materialize_

WeightsArg = None | str | Path | Mapping[str, torch.Tensor]


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Within this block every parameter a module registers is moved to the meta device at once.

    Unlike `with torch.device("meta")`, buffers stay real (a module's constructor computes them), and a
    parameter's CPU storage is `torch.empty` that is never touched before being dropped (virtual memory
    only), so even real-shape construction costs no memory or init time: `reset_parameters` then runs on
    meta tensors, a no-op. Not thread-safe: it patches `nn.Module.register_parameter` for the block.
    """
    original = nn.Module.register_parameter

    def register(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(self, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def _construct(cls, *args, moe_impl: str):
    """`cls(*args)`, passing `moe_impl` where the stage takes it (MoE stages)."""
    if "moe_impl" in inspect.signature(cls).parameters:
        return cls(*args, moe_impl=moe_impl)
    return cls(*args)


class OmniModel(nn.Module):
    def __init__(self, cfg: OmniConfig, moe_impl: str = "auto") -> None:
        super().__init__()
        # imported here so that omni_rt.model.weights and the config stay importable without the stages
        from omni_rt.model.audio_encoder import AudioEncoder
        from omni_rt.model.code2wav import Code2Wav
        from omni_rt.model.talker import Talker
        from omni_rt.model.thinker import Thinker

        self.cfg = cfg
        self.load_report: LoadReport | None = None  # set by build() when weights come from a checkpoint
        self.thinker = _construct(Thinker, cfg.thinker, moe_impl=moe_impl)
        if cfg.audio_config:
            # Where the checkpoint keeps it, so its parameter names are the checkpoint's. The Thinker's
            # forward never calls it: speech input is encoded into `inputs_embeds` before the prefill
            # (model/speech_input.py).
            self.thinker.audio_tower = AudioEncoder(cfg.audio_config)
        self.talker = _construct(Talker, cfg, moe_impl=moe_impl)
        self.code2wav = Code2Wav(cfg.code2wav)

    @classmethod
    def build(
        cls,
        cfg: OmniConfig,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | str = torch.float32,
        weights: WeightsArg = None,
        seed: int = 0,
        moe_impl: str = "auto",
    ) -> OmniModel:
        """Build at `cfg`'s shapes on `device` in `dtype`, in eval mode, without gradients.

        weights: None (storage allocated but uninitialised; on device "meta" nothing is allocated, which
        is how real-preset shapes are inspected for free), "random" (`init_random(seed)`), a Hugging Face
        checkpoint directory, or a mapping name -> tensor (`load_weights`, strict).
        """
        device = torch.device(device)
        if isinstance(dtype, str):
            resolved = getattr(torch, dtype, None)
            if not isinstance(resolved, torch.dtype):
                raise ConfigError(f"unknown dtype {dtype!r}")
            dtype = resolved
        with params_on_meta():
            model = cls(cfg, moe_impl=moe_impl)
        model.eval().requires_grad_(False)
        if device.type == "meta":
            if weights is not None:
                raise ConfigError("weights cannot be loaded onto the meta device; pass weights=None")
            return model
        if weights is None:
            materialize_(model, device, dtype)
        elif isinstance(weights, str) and weights == "random":
            init_random(model, seed, device=device, dtype=dtype)
        else:
            model.load_report = load_weights(model, weights, device=device, dtype=dtype, strict=True)
        return model

    @classmethod
    def from_checkpoint(
        cls,
        directory: str | Path,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | str = torch.bfloat16,
        moe_impl: str = "auto",
    ) -> OmniModel:
        """Config (`config.json`) and weights of a Hugging Face checkpoint directory."""
        cfg = load_hf_config(directory)
        return cls.build(cfg, device, dtype, weights=Path(directory), moe_impl=moe_impl)

    @property
    def device(self) -> torch.device:
        return self.thinker.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.thinker.lm_head.weight.dtype
