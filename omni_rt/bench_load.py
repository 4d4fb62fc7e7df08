"""`omni-rt bench --load N,...`: the load protocol of shared/reference/performance.md, what a voice server sees.

For each level N: N conversations, each in its own session of one engine (all optimisations on, the served
default sampling, seeded), start at uniformly random times in the first 3 s. Each conversation loops: send a
turn (the 57-id chat prompt as input_ids, or with `--load-speech` a 5 s spoken turn), read the reply as it
streams and play it in real time on the client's clock, then wait 1-3 s (the user speaking) and ask again,
until `--load-seconds` of wall time have passed (a reply in flight then is read and played to its end; no
new turn starts). Every random choice comes from `--seed`, so a level replays the same schedule.

Playback: it starts when the first audio delta arrives; each delta is due once the audio before it has
played (at the first delta's arrival plus the duration of the audio before it). A reply's lateness is the
largest amount by which a delta arrived after it was due, which is also how much later than uninterrupted
playback a player that stalls on a missing delta finishes the reply; the client waits for that end before
its 1-3 s pause. A reply is late when its lateness exceeds 20 ms (an audible gap at 20 ms frames).

Per level: replies, TTFA p50/p95/max, lateness p50/p95/max, late replies, audio seconds produced per wall
second, and the Thinker's yield outcome (see `omni_rt.bench.yield_outcome`). Table, JSON (the main run's
file, key "load") and a PNG chart.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from omni_rt import collector
from omni_rt.bench_measure import chat_prompt, yield_outcome

LATE_MS = 20.0  # an audible gap at 20 ms frames
STAGGER_S = 3.0  # conversations start at uniformly random times in the first 3 s
PAUSE_S = (1.0, 3.0)  # the user's turn between a reply's end and the next request
SPEECH_S = 5.0  # a spoken turn's length (`--load-speech`)
SPEECH_RATE = 16000
FRAME_S = 0.08  # one codec frame of audio


# ------------------------------------------------------------------------------------------------------
# What the client measures


def playback_lateness(arrivals: Sequence[tuple[float, int]], rate: int) -> tuple[float, float]:
    """(lateness, playback end), in seconds on the arrivals' clock, of audio deltas [(arrival, samples)].

    Playback starts at the first arrival; delta k is due at that moment plus the duration of deltas
    0..k-1. Lateness is max(0, max over k of arrival_k - due_k). A player that stalls for a missing delta
    and resumes where it stopped ends exactly `lateness` after uninterrupted playback would have.
    """
    if not arrivals:
        raise ValueError("playback_lateness needs at least one audio delta")
    if rate <= 0:
        raise ValueError(f"sample rate must be positive, got {rate}")
    t_first = arrivals[0][0]
    played = 0  # samples before the current delta
    late = 0.0
    for t, n in arrivals:
        late = max(late, t - (t_first + played / rate))
        played += n
    return late, t_first + played / rate + late


def spoken_turn(seconds: float = SPEECH_S, rate: int = SPEECH_RATE, seed: int = 0) -> np.ndarray:
    """A deterministic speech-like test signal (float32 mono, peak 0.5): voiced syllables at ~4 per second.

    A glottal source (harmonics of a pitch that glides between 95 and 165 Hz, falling in each phrase) is
    shaped by three formants that move through a sequence of vowels; each syllable has an attack and
    decay, a burst of fricative noise leads some of them, and short pauses split the phrases. Enough of
    speech's structure (pitch, formants, 4 Hz syllable rhythm) that a VAD or an encoder sees speech, not a
    tone; no claim to intelligibility.
    """
    if seconds <= 0 or rate < 8000:
        raise ValueError(f"spoken_turn needs seconds > 0 and rate >= 8000 (got {seconds}, {rate})")
    rng = np.random.default_rng(seed)
    n = int(round(seconds * rate))
    t = np.arange(n) / rate
    # syllables: ~250 ms each, with a ~300 ms pause after every 5th (phrase ends)
    bounds, s = [], 0.0
    while s < seconds:
        d = rng.uniform(0.18, 0.30)
        bounds.append((s, min(seconds, s + d)))
        s += d + (rng.uniform(0.22, 0.35) if len(bounds) % 5 == 0 else rng.uniform(0.02, 0.06))
    # vowel formants (F1, F2, F3 in Hz): a, e, i, o, u
    vowels = np.array(
        [[730, 1090, 2440], [530, 1840, 2480], [270, 2290, 3010], [570, 840, 2410], [300, 870, 2240]]
    )
    env = np.zeros(n)
    formants = np.zeros((n, 3))
    noise_env = np.zeros(n)
    for a, b in bounds:
        i0, i1 = int(a * rate), int(b * rate)
        if i1 <= i0:
            continue
        u = np.linspace(0.0, 1.0, i1 - i0)
        env[i0:i1] = np.minimum(1.0, u / 0.15) * np.exp(-2.5 * u) * rng.uniform(0.6, 1.0)
        v0, v1 = vowels[rng.integers(len(vowels))], vowels[rng.integers(len(vowels))]
        formants[i0:i1] = v0 + (v1 - v0) * u[:, None]  # a diphthong glide across the syllable
        if rng.random() < 0.4:  # a fricative onset
            m = min(i1 - i0, int(0.05 * rate))
            noise_env[i0 : i0 + m] = np.linspace(0.15, 0.0, m)
    formants[env == 0] = vowels[0]
    phrase = (t % 1.6) / 1.6
    f0 = 95.0 + 70.0 * (1.0 - phrase) * (0.8 + 0.2 * np.sin(2 * np.pi * 0.7 * t))
    phase = 2 * np.pi * np.cumsum(f0) / rate
    voiced = np.zeros(n)
    widths = np.array([90.0, 110.0, 170.0])
    # formant gains change slowly: evaluate them every 5 ms and interpolate (fast, and smooth enough)
    grid = np.arange(0, n, rate // 200)
    for h in range(1, 60):
        fh = h * f0[grid]
        g = np.sum(np.exp(-0.5 * ((fh[:, None] - formants[grid]) / widths) ** 2) * [1.0, 0.6, 0.3], axis=1)
        g = (g + 0.02) * (fh < 0.45 * rate) / h  # a -6 dB/octave source, nothing near Nyquist
        voiced += np.interp(np.arange(n), grid, g) * np.sin(h * phase)
    noise = rng.standard_normal(n)
    noise = np.diff(noise, prepend=0.0)  # high-pass: fricatives are bright
    x = voiced * env + noise * noise_env
    return (0.5 * x / max(1e-9, np.abs(x).max())).astype(np.float32)


@dataclass
class Reply:
    """One reply as the client saw it. Times in s from the level's start, ms for the measures."""

    conversation: int
    turn: int
    t_sent: float
    status: str
    ttfa_ms: float | None = None
    lateness_ms: float | None = None
    audio_s: float = 0.0
    thinker_yield: str | None = None
    error: str | None = None
    response_id: str | None = None
    arrivals: list[tuple[float, int]] | None = None  # (s from the level's start, samples) per audio delta

    @property
    def late(self) -> bool:
        return self.lateness_ms is not None and self.lateness_ms > LATE_MS


async def play_reply(
    session: Any, request: dict[str, Any], t_level: float, conv: int, turn: int
) -> tuple[Reply, float]:
    """Send one turn, read its reply and time its playback; (reply, the moment playback ends)."""
    t0 = time.perf_counter()
    arrivals: list[tuple[float, int]] = []
    rate, done, error = 24000, None, None
    rid = None
    async for ev in session.respond(**request):
        now = time.perf_counter()
        rid = rid or getattr(ev, "response_id", None)
        if ev.type == "response.output_audio.delta" and len(ev.pcm):  # an empty delta plays nothing
            arrivals.append((now, len(ev.pcm)))
            rate = ev.sample_rate
        elif ev.type == "error":
            error = f"{ev.error.code}: {ev.error.message}"
        elif ev.type == "response.done":
            done = ev
    reply = Reply(conv, turn, t0 - t_level, getattr(done, "status", "missing"), error=error, response_id=rid)
    reply.arrivals = [(round(t - t_level, 5), n) for t, n in arrivals]
    metrics = getattr(done, "metrics", None)
    # the Thinker's yield outcome per response, once the engine reports it (read defensively: see
    # bench_measure.yield_outcome for the field)
    reply.thinker_yield = getattr(metrics, "thinker_yield", None)
    end = time.perf_counter()
    if arrivals:
        late, end = playback_lateness(arrivals, rate)
        reply.ttfa_ms = (arrivals[0][0] - t0) * 1e3
        reply.lateness_ms = late * 1e3
        reply.audio_s = sum(n for _, n in arrivals) / rate
    return reply, end


# ------------------------------------------------------------------------------------------------------
# Conversations


@dataclass
class LoadPlan:
    """What every conversation of a level sends; `turn(conv, turn)` gives one request's keyword arguments."""

    text_tokens: int
    frames: int
    prompt: list[int] | None = None  # text turns: the chat prompt as input_ids
    speech: np.ndarray | None = None  # spoken turns: 16 kHz float PCM
    sampling: str = "default"  # "default": Sampling(seed=...) per request; "greedy": Sampling.greedy(...)
    seed: int = 0
    voice: str = "ethan"

    def turn(self, conv: int, turn: int) -> dict[str, Any]:
        from omni_rt.config import Sampling

        # one seed per (conversation, turn): reproducible, and not the same draws in every conversation
        seed = (self.seed * 1_000_003 + conv * 1009 + turn) % 2**31
        sampling = Sampling.greedy(seed=seed) if self.sampling == "greedy" else Sampling(seed=seed)
        req: dict[str, Any] = dict(
            max_output_tokens=self.text_tokens,
            max_audio_frames=self.frames,
            ignore_eos=True,
            sampling=sampling,
        )
        if self.speech is not None:
            req |= dict(audio=self.speech, audio_sample_rate=SPEECH_RATE)
        else:
            req["input_ids"] = list(self.prompt or [])
        return req


def _sizes(session: Any) -> tuple[int, int] | None:
    """(conversation tokens, Talker user-turn tokens) the session holds, or None where it does not say."""
    conv, ids = getattr(session, "conversation", None), getattr(session, "ids", None)
    if conv is None or ids is None:
        return None
    from omni_rt.prompt_layout import count_user_tokens

    return len(conv), count_user_tokens(conv, ids.im_start, ids.user)


def _fits(session: Any, growth: tuple[int, int] | None, frames: int) -> bool:
    """Whether the session's context still holds another turn like the last one (`growth`: conversation
    tokens and Talker user-turn tokens it added) with all its `frames` (the session would otherwise cut
    the reply's audio short to fit). A conversation that has filled its context continues in a fresh
    session: the load stays N conversations, and no reply is cut or fails for want of context."""
    held = _sizes(session)
    settings = getattr(getattr(session, "engine", None), "settings", None)
    if growth is None or held is None or settings is None:
        return True
    thinker_need = held[0] + growth[0] + 8
    talker_need = held[1] + growth[1] + 9 + frames
    return thinker_need < settings.max_context and talker_need < settings.max_talker_context


async def conversation(
    engine: Any,
    plan: LoadPlan,
    conv: int,
    t_level: float,
    deadline: float,
    rng: random.Random,
    out: list[Reply],
) -> None:
    """One conversation: start at its random moment, then turn after turn until the deadline."""
    start = rng.uniform(0.0, STAGGER_S)
    await asyncio.sleep(max(0.0, t_level + start - time.perf_counter()))
    turn, growth = 0, None
    async with contextlib.AsyncExitStack() as stack:
        session = await stack.enter_async_context(engine.session(voice=plan.voice))
        while time.perf_counter() < deadline:
            if not _fits(session, growth, plan.frames):
                await session.close()
                session = await stack.enter_async_context(engine.session(voice=plan.voice))
            before = _sizes(session)
            reply, end = await play_reply(session, plan.turn(conv, turn), t_level, conv, turn)
            out.append(reply)
            after = _sizes(session)
            if before is not None and after is not None and after[0] > before[0]:
                growth = (after[0] - before[0], after[1] - before[1])
            turn += 1
            # the user listens to the end of the reply, then speaks for 1-3 s
            wake = end + rng.uniform(*PAUSE_S)
            if wake >= deadline:
                break
            await asyncio.sleep(max(0.0, wake - time.perf_counter()))


def _pct(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    a = np.asarray(values, dtype=float)
    return {"p50": float(np.percentile(a, 50)), "p95": float(np.percentile(a, 95)), "max": float(a.max())}


def level_trace(replies: list[Reply], steps: Sequence[Any], t_level: float, t_end: float) -> dict[str, Any]:
    """A level's timeline, for finding what ran while a reply was late (`--load-trace`): every reply's
    audio arrivals, and the pipeline's step records in the level (times in s from the level's start;
    requests as indices into `responses`)."""
    ids = [r.response_id for r in replies]
    index = {rid: k for k, rid in enumerate(ids) if rid is not None}
    return {
        "responses": [
            {
                "id": r.response_id,
                "conversation": r.conversation,
                "turn": r.turn,
                "t_sent_s": round(r.t_sent, 5),
                "lateness_ms": r.lateness_ms,
                "arrivals": r.arrivals,
            }
            for r in replies
        ],  # fmt: skip
        "steps": [
            [
                s.stage,
                s.kind,
                round(s.t_start - t_level, 5),
                round(s.t_end - t_level, 5),
                [index.get(i, -1) for i in s.request_ids],
            ]
            for s in steps
            if t_level <= s.t_start <= t_end
        ],  # fmt: skip
    }


def summarise_level(n: int, replies: list[Reply], wall_s: float, **extra: Any) -> dict[str, Any]:
    """One level's row: the replies that completed carry the measures; others are counted as failed."""
    ok = [r for r in replies if r.status == "completed"]
    lat = [r.lateness_ms for r in ok if r.lateness_ms is not None]
    audio = sum(r.audio_s for r in ok)
    failed = [r for r in replies if r.status != "completed"]
    return {
        "conversations": n,
        "replies": len(ok),
        "failed": len(failed),
        "errors": sorted({r.error for r in failed if r.error})[:5],
        "ttfa_ms": _pct([r.ttfa_ms for r in ok if r.ttfa_ms is not None]),
        "lateness_ms": _pct(lat),
        "late_replies": sum(r.late for r in ok),
        "audio_s_per_s": audio / wall_s if wall_s > 0 else None,
        "audio_s": audio,
        "wall_s": wall_s,
        **extra,
        # every reply, for a closer look (when in the level it was sent, how it went)
        "per_reply": [
            {
                "conversation": r.conversation,
                "turn": r.turn,
                "t_sent_s": round(r.t_sent, 4),
                "status": r.status,
                "ttfa_ms": None if r.ttfa_ms is None else round(r.ttfa_ms, 2),
                "lateness_ms": None if r.lateness_ms is None else round(r.lateness_ms, 2),
                "audio_s": round(r.audio_s, 4),
                "thinker_yield": r.thinker_yield,
            }
            for r in sorted(replies, key=lambda r: r.t_sent)
        ],
    }


async def warm_up(engine: Any, plan: LoadPlan, n: int) -> None:
    """Before a level: `n` short replies at once, unmeasured, so that first-use costs at the level's batch
    sizes (allocations, kernel autotuning, lazily built graphs) fall outside it."""
    short = {"max_output_tokens": min(plan.text_tokens, 8), "max_audio_frames": min(plan.frames, 8)}
    async with contextlib.AsyncExitStack() as stack:
        sessions = [await stack.enter_async_context(engine.session(voice=plan.voice)) for _ in range(n)]
        t = time.perf_counter()
        await asyncio.gather(
            *(play_reply(s, plan.turn(-1 - k, 0) | short, t, -1 - k, 0) for k, s in enumerate(sessions))
        )


async def run_levels(
    engine: Any,
    levels: Sequence[int],
    plan: LoadPlan,
    args: argparse.Namespace,
    on_level: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict]:
    """Every level in one engine start: a warm-up round at the level's concurrency, then the level; all
    its sessions are closed before the next level begins."""
    rows: list[dict[str, Any]] = []
    async with engine:
        for n in levels:
            await warm_up(engine, plan, n)
            rng = random.Random(f"{args.seed}/{n}")  # the level's schedule: start times, pauses
            rngs = [random.Random(rng.random()) for _ in range(n)]
            replies: list[Reply] = []
            t_level = time.perf_counter()
            deadline = t_level + args.load_seconds
            with collector.Pauses() as pauses:  # a full collection stalls every thread: say so
                await asyncio.gather(
                    *(conversation(engine, plan, k, t_level, deadline, rngs[k], replies) for k in range(n))
                )
            t_end = time.perf_counter()
            pipeline = getattr(engine, "pipeline", None)
            row = summarise_level(
                n,
                replies,
                # the level's wall time: the fixed window, or longer when replies in flight ran past it
                max(t_end - t_level, args.load_seconds),
                turns="speech" if plan.speech is not None else "text",
                sampling=plan.sampling,
                load_seconds=args.load_seconds,
                thinker_yield=yield_outcome(
                    [r.thinker_yield for r in replies],
                    getattr(pipeline, "yields", None),
                    t_level,
                    t_end,
                    getattr(engine.settings, "yield_until", None),
                ),
            )
            row["collector"] = pauses.summary()
            if getattr(args, "load_trace", False):
                row["trace"] = level_trace(replies, getattr(pipeline, "steps", []), t_level, t_end)
            rows.append(row)
            print("[bench] " + format_load_table([row]).splitlines()[-1], file=sys.stderr, flush=True)
            if on_level is not None:
                on_level(row)  # e.g. saved at once: a run cut short keeps its finished levels
    return rows


# ------------------------------------------------------------------------------------------------------
# Sizing, output, entry


def load_settings(args: argparse.Namespace, levels: Sequence[int], prompt_len: int) -> dict[str, Any]:
    """Engine sizes for the levels: a slot per conversation, and a context that holds the turns one
    conversation can take in the wall time (each takes at least its reply's audio plus the 1 s pause)."""
    if args.load_speech:
        from omni_rt.audio.features import audio_token_count

        per_turn_user = int(audio_token_count(int(SPEECH_S * 100))) + 16
    else:
        per_turn_user = prompt_len
    audio_s = max(0.05, args.frames * FRAME_S - 0.03)
    turns = math.floor(args.load_seconds / (PAUSE_S[0] + audio_s)) + 1
    thinker = 32 + turns * (per_turn_user + args.text_tokens + 4)
    talker = 32 + turns * per_turn_user + args.frames
    up = lambda x: min(8192, 64 * math.ceil(x / 64))  # noqa: E731 - sizes in whole blocks, within reason
    return dict(max_sessions=max(levels), max_context=up(thinker), max_talker_context=up(talker))


def format_load_table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'load':>5} {'turns':>6} {'sampling':>9} {'replies':>7} {'TTFA p50/p95/max ms':>22} "
        f"{'lateness p50/p95/max ms':>26} {'late':>7} {'audio s/s':>9} {'yield->audio':>12} {'full gc (max)':>14}"
    )
    variants = any(r.get("variant", "served") != "served" for r in rows)
    width = max([len("variant")] + [len(r.get("variant", "served")) for r in rows])  # names in full
    if variants:
        head = f"{'variant':>{width}} " + head
    lines = [head, "-" * len(head)]
    for r in rows:

        def three(s: dict[str, float] | None) -> str:
            return "-" if not s else f"{s['p50']:.0f}/{s['p95']:.0f}/{s['max']:.0f}"

        y = r.get("thinker_yield") or {}
        frac = y.get("fraction_first_audio")
        lines.append(
            (f"{r.get('variant', 'served'):>{width}} " if variants else "")
            + f"{r['conversations']:>5} {r['turns']:>6} {r['sampling']:>9} {r['replies']:>7} "
            f"{three(r['ttfa_ms']):>22} {three(r['lateness_ms']):>26} "
            f"{str(r['late_replies']) + '/' + str(r['replies']):>7} {r['audio_s_per_s'] or 0:>9.2f} "
            f"{'-' if frac is None else f'{100 * frac:.0f} %':>12} {_collections(r.get('collector')):>14}"
            + (f"  ({r['failed']} failed: {'; '.join(r['errors'])})" if r["failed"] else "")
        )
    return "\n".join(lines)


def _collections(c: dict[str, float] | None) -> str:
    """A level's full collections of the cycle collector (`collector.Pauses.summary`): "2 (115 ms)"."""
    return "-" if not c else f"{c['full']} ({c['full_max_ms']:.0f} ms)" if c["full"] else "0"


def plot_load(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not rows:
        return
    x = list(range(len(rows)))
    names = [
        str(r["conversations"]) + ("" if r.get("variant", "served") == "served" else f"\n{r['variant']}")
        for r in rows
    ]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, key, label in (
        (axes[0], "ttfa_ms", "TTFA, ms"),
        (axes[1], "lateness_ms", "playback lateness, ms"),
    ):
        for q, style in (("p50", "o-"), ("p95", "s--"), ("max", "^:")):
            ax.plot(x, [(r[key] or {}).get(q, float("nan")) for r in rows], style, label=q)
        ax.set_title(label)
        ax.legend()
    axes[1].axhline(LATE_MS, color="tab:red", lw=0.8)  # the late threshold
    axes[1].set_yscale("symlog", linthresh=LATE_MS)
    axes[1].set_ylim(bottom=0)
    late = [r["late_replies"] / r["replies"] if r["replies"] else 0.0 for r in rows]
    axes[2].bar(x, late, color="tab:red", alpha=0.7, label="late replies (fraction)")
    ax2 = axes[2].twinx()
    ax2.plot(x, [r["audio_s_per_s"] or 0.0 for r in rows], "ko-", label="audio s per wall s")
    axes[2].set_ylim(0, 1)
    axes[2].set_title("late replies (bars), audio s/s (line)")
    for ax in axes:
        ax.set_xticks(x, names)
        ax.set_xlabel("conversations")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_load(
    args: argparse.Namespace, engine: Any, on_level: Callable[[dict[str, Any]], None] | None = None
) -> list[dict[str, Any]]:
    """The load rows on `engine` (sized by `load_settings`); `on_level(row)` after each level."""
    levels = parse_levels(args.load)
    plan = LoadPlan(
        text_tokens=args.text_tokens,
        frames=args.frames,
        prompt=None if args.load_speech else load_prompt(args),
        speech=spoken_turn(seed=args.seed) if args.load_speech else None,
        sampling=args.load_sampling,
        seed=args.seed,
        voice=args.voice,
    )
    rows = asyncio.run(run_levels(engine, levels, plan, args, on_level))
    for r in rows:
        # each request its own seed, from --seed, the conversation and the turn (LoadPlan.turn)
        r["sampling_detail"] = f"{args.load_sampling}, per-request seeds from --seed {args.seed}"
    return rows


def load_prompt(args: argparse.Namespace) -> list[int]:
    """The 57-id prompt: a 20-id system turn and a 24-id user turn (`--system-len`, `--load-user-len`)."""
    from omni_rt.model.config import TokenIds

    return chat_prompt(args.system_len, args.load_user_len, args.seed, TokenIds())


def parse_levels(spec: str) -> list[int]:
    try:
        levels = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--load {spec!r}: give conversation counts, e.g. 1,8,16,32,64") from None
    if not levels or any(n < 1 or n > 256 for n in levels):
        raise SystemExit(f"--load {spec!r}: counts must be 1..256 (the engine's session slots)")
    return levels
