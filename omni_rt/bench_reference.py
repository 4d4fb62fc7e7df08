"""The benchmark's reference row: transformers' `Qwen3OmniMoeForConditionalGeneration` on omni_rt's own
weights (shared storage), timed through its non-streaming `generate` at the benchmark's fixed lengths.

Its text and its audio exist only when `generate` returns, so its TTFT is the end of the Thinker's
`generate` and its TTFA the end of the whole call. It runs greedy: `generate` has no seeded per-request
sampling to match the engine's, so the row is labelled greedy wherever it appears.
"""

from __future__ import annotations

import argparse
import gc
import time
from typing import Any

import torch

from omni_rt.bench_measure import Sample


@torch.no_grad()
def reference_model(model: torch.nn.Module) -> tuple[torch.nn.Module, dict[str, Any]]:
    """transformers' `Qwen3OmniMoeForConditionalGeneration` holding `model`'s tensors (shared storage).

    Built on the meta device (no memory, no init), then given our parameters by checkpoint name with
    `load_state_dict(assign=True)`: one copy of the weights serves both. What omni_rt has no module for
    (the vision encoder) gets its own seeded random weights; buffers the reference computes
    (rotary tables, code offsets, sinusoids) are recomputed by its own `_init_weights`. Any other missing
    or unexpected tensor is an error: the two models must be the same network.
    """
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    cfg = model.cfg
    hf_cfg = Qwen3OmniMoeConfig(**cfg.to_hf())
    p0 = next(model.parameters())
    device, dtype = p0.device, p0.dtype
    with torch.device("meta"):
        ref = Qwen3OmniMoeForConditionalGeneration(hf_cfg)
    result = ref.load_state_dict(model.state_dict(), strict=False, assign=True)
    if result.unexpected_keys:
        raise RuntimeError(f"tensors the reference does not have: {result.unexpected_keys[:10]}")
    own = ("thinker.visual.",)
    buffers = {n for n, _ in ref.named_buffers()}
    missing = [k for k in result.missing_keys if not k.startswith(own) and k not in buffers]
    if missing:
        raise RuntimeError(f"reference tensors omni_rt did not provide: {missing[:10]}")
    gen = torch.Generator(device=device).manual_seed(1234)
    n_new = 0
    for mod in ref.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            if p.is_meta:  # encoders only (checked above)
                t = torch.empty(p.shape, device=device, dtype=dtype).normal_(0.0, 0.02, generator=gen)
                setattr(mod, name, torch.nn.Parameter(t, requires_grad=False))
                n_new += p.numel()
        meta_bufs = [(n, b) for n, b in mod.named_buffers(recurse=False) if b.is_meta]
        for name, b in meta_bufs:
            mod._buffers[name] = torch.empty(b.shape, device=device, dtype=b.dtype)
        if meta_bufs:
            ref._init_weights(mod)
    left = [n for n, t in [*ref.named_parameters(), *ref.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"reference tensors still on meta: {left[:10]}")
    ref.eval().requires_grad_(False)
    return ref, {"encoder_params_random": n_new, "shared_tensors": len(model.state_dict())}


def reference_samples(
    model: torch.nn.Module, prompts: list[list[int]], args: argparse.Namespace
) -> tuple[list[Sample], str | None]:
    """Time transformers' `generate` (greedy, fixed lengths) on our weights; (samples, reason if skipped)."""
    try:
        ref, _ = reference_model(model)
    except ImportError as exc:
        return [], f"transformers not importable: {exc}"
    device = next(model.parameters()).device
    thinker_end: list[float] = []
    gen_thinker = ref.thinker.generate

    def timed_thinker_generate(*a, **k):
        out = gen_thinker(*a, **k)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        thinker_end.append(time.perf_counter())
        return out

    ref.thinker.generate = timed_thinker_generate  # instance attribute: only this object is changed
    samples: list[Sample] = []
    for i, ids in enumerate(prompts):
        warm = args.reference_warmup if i == 0 else 0  # warm-up generate calls, short (2 tokens, 2 frames)
        for r in range(warm + args.reference_requests):
            x = torch.tensor([ids], device=device)
            n_text, n_frames = (2, 2) if r < warm else (args.text_tokens, args.frames)
            thinker_end.clear()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            with torch.no_grad():
                text, wav = ref.generate(
                    x,
                    speaker=args.voice.capitalize(),
                    return_audio=True,
                    thinker_max_new_tokens=n_text,
                    thinker_min_new_tokens=n_text,
                    thinker_do_sample=False,
                    # the last code 0 the Talker samples gets no residual codes: n + 1 tokens -> n frames
                    talker_max_new_tokens=n_frames + 1,
                    talker_min_new_tokens=n_frames + 1,
                    talker_do_sample=False,
                )
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t1 = time.perf_counter()
            if r < warm:
                continue
            n_text = int(text.shape[-1]) - len(ids)
            audio_s = (wav.numel() / 24000) if wav is not None else 0.0
            t_think = thinker_end[0] if thinker_end else t1
            samples.append(
                Sample(
                    prompt_len=len(ids),
                    ttft_ms=(t_think - t0) * 1e3,
                    ttfa_ms=(t1 - t0) * 1e3,
                    total_ms=(t1 - t0) * 1e3,
                    text_tokens=n_text,
                    audio_s=audio_s,
                    # not streamed: tokens over the Thinker's whole generate (prefill included)
                    text_tok_s=n_text / (t_think - t0) if t_think > t0 else None,
                    rtf=(t1 - t0) / audio_s if audio_s > 0 else None,
                )
            )
    del ref
    gc.collect()
    return samples, None
