"""What a load level's timeline says (`omni-rt bench --load N --load-trace`): each stage's calls, and for
where each reply's time to its first audio went (`first_audio_path`; what the Thinker was doing when
it was sent, `waits_at_send`), and for every late reply whether its audio was late because the frame was not made in time (the Talker) or because
it was made in time and decoded late (Code2Wav).

    python scripts/load_trace.py docs/img/bench-2026-12-03-b4ecec0-h200.json.gz --level 64

Per stage and kind (Thinker decode, Talker step and predict, Code2Wav chunk): calls, rows a call, call
time p50 / mean (host step records), and busy (the calls' summed time over the level's span). Then the late
replies (lateness > 20 ms, `bench_load.LATE_MS`), each classified at its first late delta as
`playback_lateness` defines it: the frame that delta starts with (`(samples before + shortfall) // 1920`)
was made (its `talker.predict` record ended) after the delta was due, or before. And where in their
replies the late deltas are (which chunk: 1 is a reply's second), how long before they were due their
frames were all made (slack), and the Code2Wav call that brought each: its time and rows.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omni_rt.bench_load import LATE_MS  # noqa: E402

RATE, SAMPLES_PER_FRAME, SHORTFALL = 24000, 1920, 555  # the real Code2Wav's (model/code2wav.py)
STAGES = (("thinker", "decode"), ("talker", "step"), ("talker", "predict"), ("code2wav", "chunk"))


def first_late_delta(arrivals: list, rate: int = RATE) -> tuple[float, int, float] | None:
    """(arrival, samples before it, due time) of the first delta later than LATE_MS; None if none is."""
    t_first, played = arrivals[0][0], 0
    for t, n in arrivals:
        due = t_first + played / rate
        if (t - due) * 1e3 > LATE_MS:
            return t, played, due
        played += n
    return None


def why_late(response: dict, frames_made: list[float]) -> str | None:
    """ "frame late" (made after its audio was due), "decode late" (made in time), None (not late)."""
    late = first_late_delta(response["arrivals"])
    if late is None:
        return None
    _, played, due = late
    k = (played + SHORTFALL) // SAMPLES_PER_FRAME  # the first frame of the late delta's chunk
    if k >= len(frames_made):
        return "no frame record"
    return "frame late" if frames_made[k] > due else "decode late"


def late_detail(
    response: dict, frames_made: list[float], calls: list[tuple[float, float, int]]
) -> dict | None:
    """Of a late reply's first late delta: its chunk's index in the reply, frames, lateness (ms), slack (ms
    from its chunk's last frame made to the delta's due time; negative: made after it), and the Code2Wav
    call that brought it (`calls`: this response's (start, end, rows), in order): its time and rows."""
    late = first_late_delta(response["arrivals"])
    if late is None:
        return None
    t, played, due = late
    index = next(i for i, (a, _) in enumerate(response["arrivals"]) if a == t)
    frames = max(1, round(response["arrivals"][index][1] / SAMPLES_PER_FRAME))
    last = (played + SHORTFALL) // SAMPLES_PER_FRAME + frames - 1
    call = next((c for c in reversed(calls) if c[1] <= t), None)
    return dict(
        chunk=index, frames=frames, late_ms=(t - due) * 1e3,
        slack_ms=(due - frames_made[last]) * 1e3 if last < len(frames_made) else None,
        call_ms=(call[1] - call[0]) * 1e3 if call else None, call_rows=call[2] if call else None,
    )  # fmt: skip


PATH = ("wait", "behind decode", "behind prefills", "prefill", "to talker", "last + frame 0", "to code2wav",
        "first chunk", "to client")  # fmt: skip


def _thinker_calls(steps: list) -> list:
    """The Thinker's decode steps and prefills, in the order it ran them (one thread: as recorded)."""
    return [s for s in steps if s[0] == "thinker" and s[1] in ("decode", "prefill")]


def _first_calls(steps: list) -> dict[int, dict[tuple[str, str], list]]:
    """Response index -> its first call of each (stage, kind): the step record."""
    first: dict[int, dict[tuple[str, str], list]] = collections.defaultdict(dict)
    for s in steps:
        for i in s[4]:
            first[i].setdefault((s[0], s[1]), s)
    return first


def first_audio_path(level: dict) -> dict[str, dict[str, float]]:
    """Where each reply's time to first audio went, p50 / mean / p90 ms over the level's replies: from
    sent to its prefill's start ("wait"; of it, Thinker decode steps and other prompts' prefills that ran
    meanwhile), the prefill, to its Talker start, the last prompt position and frame 0, to its first
    Code2Wav call, that call, and to the client's first audio."""
    steps, responses = level["trace"]["steps"], level["trace"]["responses"]
    thinker, first = _thinker_calls(steps), _first_calls(steps)
    rows = collections.defaultdict(list)
    for i, r in enumerate(responses):
        f = first.get(i, {})
        keys = (("thinker", "prefill"), ("talker", "last"), ("talker", "predict"), ("code2wav", "chunk"))
        if not r["arrivals"] or any(k not in f for k in keys):
            continue
        (p0, p1), (l0, _), (_, f1), (c0, c1) = (f[k][2:4] for k in keys)
        sent = r["t_sent_s"]
        overlap = collections.Counter()
        for _, kind, t0, t1, ids in thinker:
            if i not in ids:
                overlap[kind] += max(0.0, min(t1, p0) - max(t0, sent))
        for name, v in zip(PATH, (
            p0 - sent, overlap["decode"], overlap["prefill"], p1 - p0, l0 - p1, f1 - l0, c0 - f1, c1 - c0,
            r["arrivals"][0][0] - c1,
        ), strict=True):  # fmt: skip
            rows[name].append(v * 1e3)
    return {
        k: dict(p50=statistics.median(v), mean=statistics.mean(v), p90=sorted(v)[int(0.9 * (len(v) - 1))])
        for k, v in rows.items()
    }


def waits_at_send(level: dict) -> dict:
    """What the Thinker was doing when each reply was sent (a decode step, another prompt's prefill, or
    neither: between calls, e.g. the yield to a first audio), and the decode steps that then ran whole
    before its prefill (a prompt that comes during a prefill or a yield waits behind the next decode step
    of every reply). -> {"at send": counts by state, "behind a whole decode": replies, and those steps'
    p50 ms and rows}."""
    steps, responses = level["trace"]["steps"], level["trace"]["responses"]
    thinker, first = _thinker_calls(steps), _first_calls(steps)
    states, whole = collections.Counter(), []
    for i, r in enumerate(responses):
        prefill = first.get(i, {}).get(("thinker", "prefill"))
        if prefill is None:
            continue
        sent, p0 = r["t_sent_s"], prefill[2]
        at = [s[1] for s in thinker if s[2] <= sent < s[3] and i not in s[4]]
        states[at[0] if at else "between"] += 1
        whole += [s for s in thinker if s[1] == "decode" and sent <= s[2] and s[3] <= p0 and i not in s[4]][
            :1
        ]
    ms, rows = [(s[3] - s[2]) * 1e3 for s in whole], [len(s[4]) for s in whole]
    return {
        "at send": dict(states), "behind a whole decode": len(whole),
        "its p50 ms": statistics.median(ms) if ms else None, "its p50 rows": statistics.median(rows) if rows else None,
    }  # fmt: skip


def analyse(level: dict) -> dict:
    steps, responses = level["trace"]["steps"], level["trace"]["responses"]
    span = max(s[3] for s in steps) - min(s[2] for s in steps)
    stages = {}
    for stage, kind in STAGES:
        calls = [s for s in steps if s[0] == stage and s[1] == kind]
        if not calls:
            continue
        ms = [(s[3] - s[2]) * 1e3 for s in calls]
        stages[f"{stage}.{kind}"] = dict(
            calls=len(calls), rows=statistics.mean(len(s[4]) for s in calls), p50_ms=statistics.median(ms),
            mean_ms=statistics.mean(ms), busy=sum(ms) / 1e3 / span,
        )  # fmt: skip
    made = collections.defaultdict(list)  # response index -> end of each of its frames' predict call
    decoded = collections.defaultdict(list)  # response index -> its Code2Wav calls (start, end, rows)
    for stage, kind, t0, t1, ids in steps:
        for i in ids:
            if stage == "talker" and kind == "predict":
                made[i].append(t1)
            elif stage == "code2wav" and kind == "chunk":
                decoded[i].append((t0, t1, len(ids)))
    why = collections.Counter(why_late(r, made.get(i, [])) for i, r in enumerate(responses))
    why.pop(None, None)
    details = [
        d for i, r in enumerate(responses) if (d := late_detail(r, made.get(i, []), decoded.get(i, [])))
    ]
    return dict(
        conversations=level["conversations"], late=level["late_replies"], stages=stages, why_late=dict(why),
        late_at_chunk=dict(sorted(collections.Counter(d["chunk"] for d in details).items())), late_details=details,
    )  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench_json", help="the bench's JSON (.json or .json.gz) of a run with --load-trace")
    ap.add_argument("--level", type=int, action="append", help="conversations (default: every traced level)")
    args = ap.parse_args(argv)
    opener = gzip.open if args.bench_json.endswith(".gz") else open
    with opener(args.bench_json, "rt") as f:
        data = json.load(f)
    levels = [
        lv for lv in data["load"] if lv.get("trace") and (not args.level or lv["conversations"] in args.level)
    ]
    if not levels:
        print("no traced level (run the bench with --load-trace)", file=sys.stderr)
        return 1
    for lv in levels:
        a = analyse(lv)
        variant = "" if lv.get("variant", "served") == "served" else f" ({lv['variant']})"
        print(
            f"\n{a['conversations']} conversations{variant}: {a['late']} late replies; why: {a['why_late']}"
        )
        for name, s in a["stages"].items():
            print(f"  {name:18} {s['calls']:5} calls, {s['rows']:5.1f} rows, {s['p50_ms']:5.1f} / "
                  f"{s['mean_ms']:5.1f} ms p50 / mean, busy {s['busy']:.2f}")  # fmt: skip
        path = first_audio_path(lv)
        print("  to first audio, ms p50 / mean / p90: " + ", ".join(
            f"{k} {v['p50']:.1f}/{v['mean']:.1f}/{v['p90']:.1f}" for k, v in path.items()))  # fmt: skip
        w = waits_at_send(lv)
        print(f"  the Thinker when a reply was sent: {w['at send']}; then behind a whole decode step: "
              f"{w['behind a whole decode']} replies (the step p50 {w['its p50 ms'] or 0:.1f} ms, "
              f"{w['its p50 rows'] or 0:.0f} rows)")  # fmt: skip
        if a["late_details"]:
            med = lambda k, ds=a["late_details"]: statistics.median(d[k] for d in ds if d[k] is not None)  # noqa: E731
            print(f"  first late delta at chunk (1: a reply's second): {a['late_at_chunk']}")
            print(f"  p50 of the late deltas: {med('late_ms'):.0f} ms late, slack {med('slack_ms'):.0f} ms, "
                  f"brought by a Code2Wav call of {med('call_ms'):.1f} ms, {med('call_rows'):.0f} rows")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
