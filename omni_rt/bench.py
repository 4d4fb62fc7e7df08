"""`omni-rt bench`: the one benchmark protocol (shared/reference/performance.md), through the public API.

    omni-rt bench                                   # real shapes, random bf16 weights, one CUDA GPU
    omni-rt bench --preset tiny --device cpu --requests 1 --text-tokens 4 --frames 4   # CI smoke

Three chat prompts (a 20-id system turn, then user turns of 8, 24 and 64 ids; built as ids, no tokenizer),
each run `--requests` times after `--warmup` warm-up requests, at fixed lengths (64 text tokens, 64 codec
frames, end-of-sequence ignored). Per request: TTFT (respond() to the first text delta received), TTFA (to
the first audio delta), text tok/s (decode tokens after the first over their time), RTF (respond() to
response.done over the audio's duration), and the engine's per-stage timestamps. Rows, side by side: the
reference implementation (transformers' `generate` on the same weights, same lengths), this engine with
every optimisation off, each optimisation added in turn, all on; then concurrency rows (1, 4, 8
simultaneous sessions, all on). Output: a table on stdout, JSON (`--json`) and a PNG chart (`--png`).

The reference's `generate` is not streaming: its text and its audio exist only when it returns, so its
TTFT is the end of the Thinker's `generate` and its TTFA the end of the whole call.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as _dt
import gc
import hashlib
import inspect
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omni_rt.model.config import TokenIds

# ------------------------------------------------------------------------------------------------------
# Prompts


def chat_prompt(system_len: int, user_len: int, seed: int = 0, ids: TokenIds | None = None) -> list[int]:
    """A chat-formatted prompt of seeded ordinary token ids: system turn, user turn, assistant header.

    [im_start, system, \\n, <system_len ids>, im_end, \\n, im_start, user, \\n, <user_len ids>, im_end, \\n,
     im_start, assistant, \\n] -> system_len + user_len + 13 ids (57 for 20 + 24, the anchors' prompt).
    Text ids are drawn from 1000..150000, clear of every special id.
    """
    i = ids or TokenIds()
    g = torch.Generator().manual_seed(seed * 7919 + user_len)
    text = torch.randint(1000, 150000, (system_len + user_len,), generator=g).tolist()
    sys_text, user_text = text[:system_len], text[system_len:]
    out: list[int] = []
    if system_len > 0:
        out += [i.im_start, i.system, i.newline, *sys_text, i.im_end, i.newline]
    out += [i.im_start, i.user, i.newline, *user_text, i.im_end, i.newline]
    out += [i.im_start, i.assistant, i.newline]
    return out


# ------------------------------------------------------------------------------------------------------
# Measurement of one request through the public API


@dataclass
class Sample:
    """One timed request. Times in ms from the respond() call, on time.perf_counter."""

    prompt_len: int
    ttft_ms: float | None
    ttfa_ms: float | None
    total_ms: float
    text_tokens: int
    audio_s: float
    text_tok_s: float | None
    rtf: float | None
    status: str = "completed"
    stages: dict[str, float | None] = field(default_factory=dict)  # the engine's own timestamps
    token_ids: list[int] = field(default_factory=list)  # the text, for agreement between rows
    pcm_sha1: str = ""  # digest of all PCM bytes, for bit-identical repeats


def _accepts(fn: Callable, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


async def timed_request(
    session: Any, ids: Sequence[int], text_tokens: int, frames: int, sampling: Any
) -> Sample:
    """Run one response and time what the caller receives."""
    kwargs: dict[str, Any] = dict(input_ids=list(ids), max_output_tokens=text_tokens, max_audio_frames=frames)
    if _accepts(session.respond, "ignore_eos"):
        kwargs["ignore_eos"] = True  # fixed lengths: random weights must not decide the work
    if sampling is not None:
        kwargs["sampling"] = sampling
    t0 = time.perf_counter()
    first_text = first_audio = last_text = None
    first_text_tokens = n_tokens = n_samples = 0
    token_ids: list[int] = []
    pcm_hash = hashlib.sha1()
    rate = 24000
    done = None
    async for ev in session.respond(**kwargs):
        now = time.perf_counter()
        if ev.type == "response.output_text.delta":
            n = len(ev.token_ids) if ev.token_ids is not None else 1  # [] : a flushed partial character
            token_ids += list(ev.token_ids or [])
            if first_text is None:
                first_text, first_text_tokens = now, n
            n_tokens += n
            last_text = now
        elif ev.type == "response.output_audio.delta":
            if first_audio is None:
                first_audio = now
            n_samples += len(ev.pcm)
            pcm_hash.update(np.ascontiguousarray(ev.pcm).tobytes())
            rate = ev.sample_rate
        elif ev.type == "error":
            raise RuntimeError(f"benchmark request failed: {ev.error.code}: {ev.error.message}")
        elif ev.type == "response.done":
            done = ev
    t_end = time.perf_counter()
    audio_s = n_samples / rate
    decode = n_tokens - first_text_tokens
    tok_s = None
    if first_text is not None and last_text is not None and last_text > first_text and decode > 0:
        tok_s = decode / (last_text - first_text)
    stages: dict[str, float | None] = {}
    if done is not None and getattr(done, "metrics", None) is not None:
        m = done.metrics
        stages = {
            k: getattr(m, k, None) for k in ("thinker_first_token_ms", "talker_first_code_ms", "first_pcm_ms")
        }
    return Sample(
        prompt_len=len(ids),
        ttft_ms=None if first_text is None else (first_text - t0) * 1e3,
        ttfa_ms=None if first_audio is None else (first_audio - t0) * 1e3,
        total_ms=(t_end - t0) * 1e3,
        text_tokens=n_tokens,
        audio_s=audio_s,
        text_tok_s=tok_s,
        rtf=(t_end - t0) / audio_s if audio_s > 0 else None,
        status=getattr(done, "status", "missing"),
        stages=stages,
        token_ids=token_ids,
        pcm_sha1=pcm_hash.hexdigest(),
    )


def _stat(values: list[float | None]) -> dict[str, float] | None:
    v = [x for x in values if x is not None]
    if not v:
        return None
    return {"median": statistics.median(v), "min": min(v), "max": max(v)}


def token_agreement(a: Sequence[Sample], b: Sequence[Sample]) -> float | None:
    """Greedy text agreement of two rows: per prompt (first request of each), the fraction of positions
    whose token ids are equal (a length difference counts as disagreement), averaged over prompts."""
    first_a = {s.prompt_len: s.token_ids for s in reversed(a)}
    first_b = {s.prompt_len: s.token_ids for s in reversed(b)}
    fracs = []
    for n in sorted(first_a.keys() & first_b.keys()):
        x, y = first_a[n], first_b[n]
        if max(len(x), len(y)) == 0:
            continue
        fracs.append(sum(p == q for p, q in zip(x, y, strict=False)) / max(len(x), len(y)))
    return sum(fracs) / len(fracs) if fracs else None


@torch.no_grad()
def teacher_forced_agreement(
    model: Any, prompts: dict[int, list[int]], samples: Sequence[Sample], sampling: Any
) -> dict[str, Any] | None:
    """Greedy next-token agreement of the plain path with a row's replies, position by position.

    For the first request of each prompt, the model as it stands (the caller removes the kernels first)
    reads the prompt and the row's reply in one eager forward; at each reply position its greedy choice,
    after the engine's logits processing (the repetition penalty over all that came before), is compared
    with the token the row emitted. Unlike the free-running `token_agreement`, a flipped near-tie (random
    weights' logits are nearly flat) costs one position, not every later one: issue 2's per-position
    measure, applied to the fast path. Returns {"agreement" (averaged over prompts), "positions",
    "max_mismatch_ulps"}: the largest gap, in bf16 ulps of the plain path's top score, between the plain
    path's choice and the row's token where they differ (<= 1-2: a tie under bf16 rounding).
    """
    from omni_rt.model.offline import StageSampler
    from omni_rt.model.sampling import process_logits

    thinker = model.thinker
    dev = thinker.lm_head.weight.device
    fracs, positions, worst = [], 0, 0.0
    for s in {s.prompt_len: s for s in reversed(samples)}.values():
        prompt, reply = prompts.get(s.prompt_len), s.token_ids
        if prompt is None or not reply:
            continue
        ids = torch.tensor(prompt + reply[:-1], device=dev)[None]  # [1, T]
        cache = thinker.allocate_cache(1, ids.shape[1])  # exactly T rows: the plain unmasked prefill
        slot = torch.zeros(1, dtype=torch.long, device=dev)
        logits, _ = thinker(ids, torch.arange(ids.shape[1], device=dev)[None], cache, slot)  # [1, T, V]
        pick = StageSampler(sampling.thinker, thinker.cfg.vocab_size, device=dev)
        pick.observe(torch.tensor(prompt, device=dev)[None])
        agree = 0
        for i, tok in enumerate(reply):
            scores, _ = process_logits(logits[:, len(prompt) - 1 + i], pick.params, pick.seen, pick.suppress)
            top = scores[0].max()
            if scores[0, tok] == top:
                agree += 1
            else:
                ulp = 2.0 ** (torch.floor(torch.log2(top.abs().clamp_min(1e-30))).item() - 7)
                worst = max(worst, (top - scores[0, tok]).item() / ulp)
            pick.observe(torch.tensor([[tok]], device=dev))
        fracs.append(agree / len(reply))
        positions += len(reply)
    if not fracs:
        return None
    return {"agreement": sum(fracs) / len(fracs), "positions": positions, "max_mismatch_ulps": worst}


async def determinism_check(
    engine: Any, ids: list[int], args: argparse.Namespace, sampling: Any
) -> dict[str, Any]:
    """The same request alone twice, then `c` copies at once: every run must give the same bits
    (token ids and PCM). Meaningful with `deterministic=True` in the engine's settings."""
    runs: list[Sample] = []
    async with engine:
        for _ in range(2):
            async with engine.session(voice=args.voice) as s:
                runs.append(await timed_request(s, ids, args.text_tokens, args.frames, sampling))
        c = max(2, args.determinism_concurrency)
        async with contextlib.AsyncExitStack() as stack:
            sessions = [await stack.enter_async_context(engine.session(voice=args.voice)) for _ in range(c)]
            runs += await asyncio.gather(
                *(timed_request(s, ids, args.text_tokens, args.frames, sampling) for s in sessions)
            )
    ref = runs[0]
    same = [r.token_ids == ref.token_ids and r.pcm_sha1 == ref.pcm_sha1 for r in runs]
    return {
        "runs": len(runs),
        "alone_then_concurrent": [1, 1, c],
        "bit_identical": all(same),
        "identical_runs": sum(same),
        "text_tokens": ref.text_tokens,
        "pcm_sha1": ref.pcm_sha1,
    }


def summarise(name: str, samples: list[Sample], **extra: Any) -> dict[str, Any]:
    """Medians with min-max over the samples, and the stage timestamps of the median-TTFA request."""
    row: dict[str, Any] = {"row": name, "requests": len(samples), **extra}
    for key in ("ttft_ms", "ttfa_ms", "text_tok_s", "rtf", "total_ms", "audio_s"):
        row[key] = _stat([getattr(s, key) for s in samples])
    row["text_tokens"] = sorted({s.text_tokens for s in samples})
    row["statuses"] = sorted({s.status for s in samples})
    with_audio = sorted((s for s in samples if s.ttfa_ms is not None), key=lambda s: s.ttfa_ms)
    med = (
        with_audio[len(with_audio) // 2] if with_audio else (samples[len(samples) // 2] if samples else None)
    )
    if med is not None:
        row["median_request"] = asdict(med)
    return row


# ------------------------------------------------------------------------------------------------------
# Rows


def row_plan(device: str, kernel_ok: bool) -> list[tuple[str, dict[str, Any]]]:
    """Cumulative settings: every optimisation off, then each one added in turn; the last is all on.

    The switches come from `EngineSettings`: every field where the defaults differ from `all_off()`
    is one step (known ones in a meaningful order, any newer ones after them), so a new optimisation
    setting gets its own row without touching the benchmark.
    """
    from omni_rt.config import EngineSettings

    on, off = EngineSettings().model_dump(), EngineSettings.all_off().model_dump()
    differ = {k for k in on if on[k] != off[k]}
    known: list[tuple[str, tuple[str, ...]]] = [
        ("+ cuda graphs", ("cuda_graphs",)),
        ("+ prefill graphs", ("prefill_graphs",)),
        ("+ triton MoE decode", ("moe_backend",)),
        ("+ triton MoE prefill", ("moe_prefill_kernel",)),
        ("+ fused kernels", ("fused_kernels",)),
        ("+ packed projections", ("packed_projections",)),
        ("+ event hand-off", ("handoff",)),
        ("+ talker prefill overlap", ("talker_overlap_prefill",)),
        ("+ frame 0 in prefill", ("frame0_in_prefill",)),
        ("+ 1-frame first chunk", ("first_chunk_frames", "chunk_growth", "max_chunk_frames")),
        ("+ yield to talker", ("yield_to_talker_ms",)),
        ("+ yield until first audio", ("yield_until",)),
    ]
    # CUDA graphs and packed projections: off on a CPU by default (nothing to show there)
    gpu_only = {("cuda_graphs",), ("prefill_graphs",), ("packed_projections",)}
    # Triton kernels: a row only where they run
    needs_kernels = {("moe_backend",), ("moe_prefill_kernel",), ("fused_kernels",)}
    covered = {f for _, fields in known for f in fields}
    steps: list[tuple[str, dict[str, Any]]] = []
    for name, fields in known:
        change = {f: on[f] for f in fields if f in differ}
        if fields in needs_kernels and not kernel_ok:
            continue
        if change and not (device == "cpu" and fields in gpu_only):
            steps.append((name, change))
    steps += [(f"+ {f.replace('_', ' ')}", {f: on[f]}) for f in sorted(differ - covered)]
    plan, acc = [("all off", {})], {}
    for name, change in steps:
        acc = acc | change
        plan.append((name, dict(acc)))
    plan[-1] = (plan[-1][0] + " (all on)", plan[-1][1])
    return plan


def _settings(base: dict[str, Any], overrides: dict[str, Any]) -> Any:
    from omni_rt.config import EngineSettings

    return EngineSettings.all_off(**(base | overrides))


def _engine_model(engine: Any) -> torch.nn.Module | None:
    for name in ("model", "_model", "omni"):
        m = getattr(engine, name, None)
        if isinstance(m, torch.nn.Module):
            return m
    return None


def _load_engine(args: argparse.Namespace, settings: Any, first: Any = None) -> Any:
    """The first row loads the model (`Engine.load`); later rows wrap the same model in a new Engine
    with their settings, so the weights are built once per run."""
    import omni_rt

    if first is None:
        kwargs: dict[str, Any] = dict(device=args.device, dtype=args.dtype, settings=settings, seed=args.seed)
        if args.random_weights:
            kwargs["random_weights"] = True
        return omni_rt.Engine.load(args.preset, **kwargs)
    model = first.model

    def stages(s: Any) -> Any:
        from omni_rt.pipeline.runners import build_runners

        return build_runners(model, s)

    return omni_rt.Engine(first.cfg, first.tokenizer, stages, settings, model=model, name=first.name)


async def bench_engine(
    engine: Any, prompts: list[list[int]], args: argparse.Namespace, sampling: Any, concurrency: Sequence[int]
) -> tuple[list[Sample], dict[int, tuple[list[Sample], float]], dict[str, dict[str, float]]]:
    """One engine start: the prompts' requests (each in a fresh session), then the concurrency rounds.

    Concurrency c: c sessions respond at once, `conc_repeats` rounds after one warm-up round; returns
    {c: (samples, aggregate text tokens/s over the rounds' wall time)}.
    """
    samples: list[Sample] = []
    conc: dict[int, tuple[list[Sample], float]] = {}
    steps: dict[str, dict[str, float]] = {}
    async with engine:
        t0 = time.perf_counter()
        for i, ids in enumerate(prompts):
            warm = args.warmup if (i == 0 or not args.warmup_once) else 0
            for r in range(warm + args.requests):
                over = args.row_budget_s and time.perf_counter() - t0 > args.row_budget_s
                if over and r > warm:  # a slow row: every prompt still gets one timed request
                    break
                async with engine.session(voice=args.voice) as s:
                    sample = await timed_request(s, ids, args.text_tokens, args.frames, sampling)
                if r >= warm:
                    samples.append(sample)
        steps = step_summary(getattr(getattr(engine, "pipeline", None), "steps", None) or [])
        ids = prompts[len(prompts) // 2]
        for c in concurrency:
            got_all: list[Sample] = []
            tokens, wall = 0, 0.0
            for r in range(1 + args.conc_repeats):
                async with contextlib.AsyncExitStack() as stack:
                    sessions = [
                        await stack.enter_async_context(engine.session(voice=args.voice)) for _ in range(c)
                    ]
                    t0 = time.perf_counter()
                    got = await asyncio.gather(
                        *(timed_request(s, ids, args.text_tokens, args.frames, sampling) for s in sessions)
                    )
                    dt = time.perf_counter() - t0
                if r >= 1:
                    got_all += got
                    tokens += sum(g.text_tokens for g in got)
                    wall += dt
            conc[c] = (got_all, tokens / wall if wall > 0 else 0.0)
    return samples, conc, steps


def step_summary(steps: Sequence[Any]) -> dict[str, dict[str, float]]:
    """Where the time goes: per (stage, kind) of the pipeline's step log, count and ms per call.

    A step's time runs from the stage's call to its return with ints/PCM on the host, so it includes the
    GPU work and the stage's sync; steps of different stages overlap in time.
    """
    by: dict[str, list[float]] = {}
    for st in steps:
        by.setdefault(f"{st.stage}.{st.kind}", []).append((st.t_end - st.t_start) * 1e3)
    return {
        k: {"count": len(v), "median_ms": statistics.median(v), "total_ms": sum(v)}
        for k, v in sorted(by.items())
    }


# ------------------------------------------------------------------------------------------------------
# The reference implementation on our weights


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


# ------------------------------------------------------------------------------------------------------
# Output


def _fmt(s: dict[str, float] | None, digits: int = 1) -> str:
    if not s:
        return "-"
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'row':30} {'n':>3} {'TTFT ms':>22} {'TTFA ms':>22} {'text tok/s':>22} {'RTF':>20} "
        f"{'thinker 1st':>11} {'talker 1st':>10} {'first PCM':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        if r.get("skipped"):
            lines.append(f"{r['row']:30} skipped: {r['skipped']}")
            continue
        st = (r.get("median_request") or {}).get("stages") or {}

        def ms(k: str, st: dict = st) -> str:
            v = st.get(k)
            return "-" if v is None else f"{v:.1f}"

        lines.append(
            f"{r['row']:30} {r['requests']:>3} {_fmt(r['ttft_ms']):>22} {_fmt(r['ttfa_ms']):>22} "
            f"{_fmt(r['text_tok_s']):>22} {_fmt(r['rtf'], 3):>20} {ms('thinker_first_token_ms'):>11} "
            f"{ms('talker_first_code_ms'):>10} {ms('first_pcm_ms'):>9}"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if not r.get("skipped") and r.get("ttfa_ms")]
    if not rows:
        return
    names = [r["row"] for r in rows]
    fig, axes = plt.subplots(2, 2, figsize=(14, 9))
    for ax, (key, label, log) in zip(
        axes.flat,
        [
            ("ttfa_ms", "TTFA, ms (median, min-max)", True),
            ("ttft_ms", "TTFT, ms", True),
            ("text_tok_s", "Thinker text tokens/s", False),
            ("rtf", "RTF (lower is better)", True),
        ],
        strict=True,
    ):
        med = [(r[key] or {}).get("median", float("nan")) for r in rows]
        lo = [m - (r[key] or {}).get("min", m) for m, r in zip(med, rows, strict=True)]
        hi = [(r[key] or {}).get("max", m) - m for m, r in zip(med, rows, strict=True)]
        ax.barh(range(len(rows)), med, xerr=[lo, hi], color="tab:blue", alpha=0.8)
        ax.set_yticks(range(len(rows)), names, fontsize=8)
        ax.invert_yaxis()
        ax.set_title(label)
        if log and all(m == m and m > 0 for m in med):
            ax.set_xscale("log")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _commit() -> str:
    """HEAD's short hash, "+dirty" when tracked files differ from it (a copied tree whose .git is stale
    says so instead of naming a commit it does not run); OMNI_RT_COMMIT overrides."""
    if os.environ.get("OMNI_RT_COMMIT"):
        return os.environ["OMNI_RT_COMMIT"]

    def git(*args: str) -> str:
        out = subprocess.run(
            ["git", *args], capture_output=True, text=True, timeout=5, cwd=Path(__file__).parent
        )
        return out.stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        if not head:
            return "unknown"
        return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except Exception:  # noqa: BLE001 - no git (e.g. an installed wheel)
        return "unknown"


# ------------------------------------------------------------------------------------------------------
# Entry point


def _save(path: str, meta: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="omni-rt bench",
        description="The omni_rt benchmark protocol: one row per optimisation switch (all off, each on, all "
        "on), concurrency rows and the reference implementation, timed per request; a table on stdout, "
        "--json and --png written at the end. The real shapes need a CUDA GPU; on a CPU try "
        "--preset tiny --device cpu --requests 1.",
    )
    ap.add_argument("--preset", default="qwen3-omni-30b-a3b", help="preset name or checkpoint dir")
    ap.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cuda or cpu (default: cuda if any)",
    )
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument(
        "--no-random-weights",
        dest="random_weights",
        action="store_false",
        help="load --preset as a checkpoint directory's weights (default: seeded random weights)",
    )
    ap.add_argument("--requests", type=int, default=5, help="timed requests per prompt")
    ap.add_argument("--warmup", type=int, default=1, help="warm-up requests per prompt")
    ap.add_argument(
        "--warmup-once", action="store_true", help="warm up on the first prompt only (saves GPU time)"
    )
    ap.add_argument(
        "--row-budget-s",
        type=float,
        default=0.0,
        help="stop a row's timed requests after this many seconds, one per prompt at least (0: no limit; "
        "the slow rows then show fewer requests in the n column)",
    )
    ap.add_argument("--text-tokens", type=int, default=64, help="text tokens per reply (fixed length)")
    ap.add_argument(
        "--frames", type=int, default=64, help="codec frames per reply, 80 ms each (fixed length)"
    )
    ap.add_argument("--system-len", type=int, default=20, help="system-turn length in ids")
    ap.add_argument("--prompts", default="8,24,64", help="user-turn lengths in ids")
    ap.add_argument(
        "--rows", default="all", help="'all', 'none' (reference only) or comma-separated indices of the rows"
    )
    ap.add_argument(
        "--concurrency", default="1,4,8", help="simultaneous sessions for the all-on rows; '' none"
    )
    ap.add_argument("--conc-repeats", type=int, default=2, help="rounds of each concurrency row")
    ap.add_argument(
        "--reference",
        choices=("auto", "on", "off"),
        default="auto",
        help="time the reference implementation's generate too (auto: where it is installed)",
    )
    ap.add_argument("--reference-requests", type=int, default=1, help="per prompt (generate is slow)")
    ap.add_argument(
        "--reference-warmup", type=int, default=1, help="short warm-up generate calls, first prompt"
    )
    ap.add_argument(
        "--determinism",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="after the rows: all on + deterministic=True, the same request alone and concurrently, bits compared",
    )
    ap.add_argument(
        "--determinism-concurrency", type=int, default=4, help="sessions of the determinism check"
    )
    ap.add_argument("--voice", default="ethan", help="speaker of every reply")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights, prompts and sampling")
    ap.add_argument("--json", default="bench.json", help="where the rows go as JSON (default: bench.json)")
    ap.add_argument("--png", default="bench.png", help="where the chart goes (default: bench.png)")
    args = ap.parse_args(argv)
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from omni_rt.config import Sampling

    ids_cfg = TokenIds()
    prompts = [chat_prompt(args.system_len, int(n), args.seed, ids_cfg) for n in args.prompts.split(",") if n]
    sampling = Sampling.greedy(seed=args.seed)
    from omni_rt.engine import apply_kernels, triton_runs

    kernel_ok = triton_runs(torch.device(args.device))
    if args.device.startswith("cuda") and not kernel_ok:
        print("[bench] the Triton kernels cannot run here: no kernel rows", file=sys.stderr)
    plan = row_plan("cpu" if args.device == "cpu" else "cuda", kernel_ok)
    if args.rows != "all":
        keep = {int(i) for i in args.rows.split(",") if i and i != "none"}
        if keep - set(range(len(plan))):
            names = ", ".join(f"{i}: {n}" for i, (n, _) in enumerate(plan))
            raise SystemExit(f"--rows {args.rows}: this run's rows are {names}")
        plan = [p for i, p in enumerate(plan) if i in keep]
    concurrency = [int(c) for c in args.concurrency.split(",") if c]
    # caches sized for this run: the longest prompt plus its output, and the largest concurrency
    longest = max(len(p) for p in prompts) + args.text_tokens + 8
    base = dict(
        max_sessions=max([1, *concurrency, max(2, args.determinism_concurrency) if args.determinism else 1]),
        max_context=max(64, longest),
        max_talker_context=max(64, longest + args.frames),
    )
    meta = {
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "commit": _commit(),
        "device": torch.cuda.get_device_name()
        if args.device.startswith("cuda")
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "args": vars(args),
        "prompt_lengths": [len(p) for p in prompts],
    }
    rows: list[dict[str, Any]] = []
    conc_rows: list[dict[str, Any]] = []
    first = None  # the first row's engine: later rows reuse its model
    row_samples: dict[str, list[Sample]] = {}
    for idx, (name, overrides) in enumerate(plan):
        settings = _settings(base, overrides)
        t_load = time.perf_counter()
        engine = _load_engine(args, settings, first)
        if first is not None:  # a model shared with earlier rows: their kernels off, this row's on
            apply_kernels(first.model, settings)
        load_s = time.perf_counter() - t_load
        print(f"[bench] {name}: engine ready in {load_s:.1f} s", file=sys.stderr, flush=True)
        last = idx == len(plan) - 1
        t_row = time.perf_counter()
        samples, conc, steps = asyncio.run(
            bench_engine(engine, prompts, args, sampling, concurrency if last else ())
        )
        row_s = time.perf_counter() - t_row
        row_samples[name] = samples
        rows.append(summarise(name, samples, settings=overrides, load_s=load_s, stage_steps=steps))
        brief = ", ".join(f"{k} {v['count']}x{v['median_ms']:.2f}ms" for k, v in steps.items())
        print(f"[bench]   steps: {brief}", file=sys.stderr, flush=True)
        print(f"[bench] {name}: {row_s:.1f} s", file=sys.stderr, flush=True)
        print(format_table(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
        _save(args.json, meta, rows + conc_rows)  # partial results survive a run cut short
        for c, (cs, agg) in conc.items():
            conc_rows.append(summarise(f"concurrency {c} (all on)", cs, aggregate_text_tok_s=agg))
        if first is None:
            first = engine
    rows += conc_rows
    # greedy text of each row against the plain path (every optimisation off), per prompt
    if "all off" in row_samples:
        for r in rows:
            if r["row"] in row_samples:
                r["token_agreement_vs_all_off"] = token_agreement(
                    row_samples[r["row"]], row_samples["all off"]
                )
    # per position, against the plain path itself (no kernels, no graphs), given each row's own text
    if first is not None and row_samples:
        apply_kernels(first.model, _settings(base, {}))
        by_len = {len(p): p for p in prompts}
        for r in rows:
            if r["row"] in row_samples:
                r["teacher_forced_agreement"] = teacher_forced_agreement(
                    first.model, by_len, row_samples[r["row"]], sampling
                )

    determinism = None
    if args.determinism and first is not None and plan:
        settings = _settings(base, plan[-1][1] | {"deterministic": True})
        engine = _load_engine(args, settings, first)
        apply_kernels(first.model, settings)
        determinism = asyncio.run(determinism_check(engine, prompts[len(prompts) // 2], args, sampling))
        meta["determinism"] = determinism

    want_ref = args.reference == "on" or (args.reference == "auto" and args.device.startswith("cuda"))
    if want_ref:
        model = _engine_model(first) if first is not None else None
        if model is None and first is None:  # reference-only run: the same seeded weights Engine.load builds
            from omni_rt.model.config import preset
            from omni_rt.model.omni import OmniModel

            model = OmniModel.build(
                preset(args.preset), device=args.device, dtype=args.dtype, weights="random", seed=args.seed
            )
        if model is None:
            rows.insert(0, {"row": "reference (transformers generate)", "skipped": "engine exposes no model"})
        else:
            try:
                samples, why = reference_samples(model, prompts, args)
            except Exception as exc:  # noqa: BLE001 - the reference row must not sink the engine's rows
                samples, why = [], f"{type(exc).__name__}: {exc}"
            name = "reference (transformers generate)"
            rows.insert(0, {"row": name, "skipped": why} if why else summarise(name, samples))
    del first
    gc.collect()

    table = format_table(rows)
    print(table)
    agree = [
        f"{r['row']}: {100 * r['token_agreement_vs_all_off']:.1f} %"
        for r in rows
        if r.get("token_agreement_vs_all_off") is not None
    ]
    if agree:
        print("greedy text agreement with 'all off': " + "; ".join(agree))
    forced = [
        f"{r['row']}: {100 * tf['agreement']:.1f} % (mismatches within {tf['max_mismatch_ulps']:.1f} ulp)"
        for r in rows
        if (tf := r.get("teacher_forced_agreement")) is not None
    ]
    if forced:
        print("greedy next-token agreement with the plain path, per position: " + "; ".join(forced))
    if determinism is not None:
        print(
            f"deterministic mode (all on): {determinism['identical_runs']}/{determinism['runs']} runs "
            f"bit-identical (2 alone, {determinism['alone_then_concurrent'][-1]} at once)"
        )
    _save(args.json, meta, rows)
    if args.png:
        try:
            plot(rows, Path(args.png), f"omni-rt bench · {args.preset} · {meta['device']} · {meta['commit']}")
        except ImportError as exc:
            print(f"[bench] no chart: {exc}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
