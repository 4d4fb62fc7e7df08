"""The benchmark's measurement through the public API: the prompts, one timed request as the caller sees
it, a row's passes of requests in one engine start, and the summaries (medians, stage steps, the Thinker's
yield outcome). `omni_rt.bench` (the protocol's rows and entry point) and `omni_rt.bench_load` build on it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import inspect
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
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
    thinker_yield: str | None = None  # the engine's per-response yield outcome, where it reports one


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
    thinker_yield = None
    if done is not None and getattr(done, "metrics", None) is not None:
        m = done.metrics
        stages = {
            k: getattr(m, k, None) for k in ("thinker_first_token_ms", "talker_first_code_ms", "first_pcm_ms")
        }
        thinker_yield = getattr(m, "thinker_yield", None)  # see yield_outcome
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
        thinker_yield=thinker_yield,
    )


def _stat(values: list[float | None]) -> dict[str, float] | None:
    v = [x for x in values if x is not None]
    if not v:
        return None
    return {"median": statistics.median(v), "min": min(v), "max": max(v)}


def sampling_label(kind: str, seed: int | None) -> str:
    """How a row sampled, as the table and the JSON say it: "default" (the Session's `Sampling()`, the
    served configuration) or "greedy" (`Sampling.greedy()`), with the seed."""
    return f"{kind} (seed {seed})"


def yield_outcome(
    per_response: Sequence[str | None],
    records: Sequence[Any] | None,
    t0: float,
    t1: float,
    yield_until: str | None,
) -> dict[str, Any] | None:
    """How the Thinker's yield to the Talker ended, for the requests of a row (or a load level).

    Per response, where the engine reports it: `ResponseDone.metrics.thinker_yield`, one of "first_audio"
    (the wait ended because the response's first audio was out, or it was out before the Thinker's next
    step so no wait was needed: "not_needed"), "frame0" (frame 0 left the Talker, `yield_until="frame0"`),
    "cap" (`yield_to_talker_ms` ran out first), "stop", or None (no yield configured). The fraction is
    of responses with an outcome. Until the engine has that field, the pipeline's own log of waits
    (`Pipeline.yields`, `woke_by` "frame0" | "cap" | "stop"; with `yield_until="first_audio"` its "frame0"
    means the first audio was out) in the window [t0, t1] gives the same fraction per wait; one wait may
    cover several requests of a batch, and a response that needed no wait has no record.
    """
    outcomes = [o for o in per_response if o is not None]
    if outcomes:
        counts = {o: outcomes.count(o) for o in sorted(set(outcomes))}
        on_audio = sum(counts.get(k, 0) for k in ("first_audio", "frame0", "not_needed"))
        return {
            "source": "metrics.thinker_yield (per response)",
            "counts": counts,
            "fraction_first_audio": on_audio / len(outcomes),
        }
    waits = _window(records, t0, t1)
    if not waits:
        return None
    woke = [r.woke_by for r in waits]
    audio_label = "first_audio" if yield_until == "first_audio" else "frame0"
    counts = {(audio_label if w == "frame0" else w): woke.count(w) for w in sorted(set(woke))}
    return {
        "source": "pipeline.yields (per wait; the engine reports no per-response outcome)",
        "yield_until": yield_until,
        "counts": counts,
        "fraction_first_audio": counts.get("first_audio", 0) / len(waits),
        "median_wait_ms": statistics.median((r.t_end - r.t_start) * 1e3 for r in waits),
    }


# What the JSON keeps of every request, in the order they ran: enough to tell an outlier (a cold first
# request of a prompt length, a yield that ended at its cap) from the rest.
PER_REQUEST = ("prompt_len", "ttft_ms", "ttfa_ms", "rtf", "status", "thinker_yield")


def summarise(name: str, samples: list[Sample], **extra: Any) -> dict[str, Any]:
    """Medians with min-max over the samples, the stage timestamps of the median-TTFA request, and each
    request's figures (`PER_REQUEST`) in the order they ran."""
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
    row["per_request"] = [{key: getattr(s, key) for key in PER_REQUEST} for s in samples]
    return row


# ------------------------------------------------------------------------------------------------------
# One engine start: passes of requests, concurrency rounds


@dataclass
class Pass:
    """One set of requests in a row's engine start, all with one sampling."""

    name: str
    sampling: Any
    timed: bool = True  # False: one request per prompt and no warm-up (a greedy agreement pass)


@dataclass
class PassResult:
    samples: list[Sample]
    steps: dict[str, dict[str, float]]  # step_summary of the pass's own window
    thinker_yield: dict[str, Any] | None  # yield_outcome of the pass's own window


def _window(records: Sequence[Any] | None, t0: float, t1: float) -> list[Any]:
    """The pipeline log's records that lie in [t0, t1] (the log is trimmed by age, so not by index)."""
    return [r for r in records or () if t0 <= r.t_start and r.t_end <= t1]


def _outcome(engine: Any, samples: Sequence[Sample], t0: float, t1: float) -> dict[str, Any] | None:
    pipeline = getattr(engine, "pipeline", None)
    until = getattr(getattr(engine, "settings", None), "yield_until", None)
    return yield_outcome([s.thinker_yield for s in samples], getattr(pipeline, "yields", None), t0, t1, until)


async def run_pass(engine: Any, prompts: list[list[int]], args: argparse.Namespace, p: Pass) -> PassResult:
    """The prompts' requests, each in a fresh session: `--warmup` + `--requests` per prompt when timed."""
    samples: list[Sample] = []
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        warm = args.warmup if (i == 0 or not args.warmup_once) and p.timed else 0
        for r in range(warm + (args.requests if p.timed else 1)):
            over = args.row_budget_s and time.perf_counter() - t0 > args.row_budget_s
            if over and r > warm:  # a slow row: every prompt still gets one timed request
                break
            async with engine.session(voice=args.voice) as s:
                sample = await timed_request(s, ids, args.text_tokens, args.frames, p.sampling)
            if r >= warm:
                samples.append(sample)
    t1 = time.perf_counter()
    steps = _window(getattr(getattr(engine, "pipeline", None), "steps", None), t0, t1)
    return PassResult(samples, step_summary(steps), _outcome(engine, samples, t0, t1))


async def bench_engine(
    engine: Any,
    prompts: list[list[int]],
    args: argparse.Namespace,
    passes: Sequence[Pass],
    concurrency: Sequence[int] = (),
    conc_sampling: Any = None,
) -> tuple[dict[str, PassResult], dict[int, tuple[list[Sample], float, dict[str, Any] | None]]]:
    """One engine start: each pass in turn, then the concurrency rounds (with `conc_sampling`).

    Concurrency c: c sessions respond at once, `conc_repeats` rounds after one warm-up round; returns
    {c: (samples, aggregate text tokens/s over the rounds' wall time, yield outcome)}.
    """
    results: dict[str, PassResult] = {}
    conc: dict[int, tuple[list[Sample], float, dict[str, Any] | None]] = {}
    async with engine:
        for p in passes:
            results[p.name] = await run_pass(engine, prompts, args, p)
        ids = prompts[len(prompts) // 2]
        for c in concurrency:
            got_all: list[Sample] = []
            tokens, wall = 0, 0.0
            t_first = None
            for r in range(1 + args.conc_repeats):
                async with contextlib.AsyncExitStack() as stack:
                    sessions = [
                        await stack.enter_async_context(engine.session(voice=args.voice)) for _ in range(c)
                    ]
                    t0 = time.perf_counter()
                    got = await asyncio.gather(
                        *(
                            timed_request(s, ids, args.text_tokens, args.frames, conc_sampling)
                            for s in sessions
                        )
                    )
                    dt = time.perf_counter() - t0
                if r >= 1:
                    t_first = t0 if t_first is None else t_first
                    got_all += got
                    tokens += sum(g.text_tokens for g in got)
                    wall += dt
            yields = _outcome(engine, got_all, t_first, time.perf_counter()) if t_first else None
            conc[c] = (got_all, tokens / wall if wall > 0 else 0.0, yields)
    return results, conc


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
