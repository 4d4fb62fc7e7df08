"""Real-time factor of the embedded default on this machine's CPU, as `omni-rt serve` runs it.

    python3 scripts/cpu_rtf.py                                   # tiny, served settings, 3 replies of 8 s
    python3 scripts/cpu_rtf.py --reps 5 --compare '{"switches off": {"cpu_stage_threads": null,
        "urgent_text_lead": null, "early_chunks": false}}'      # EngineSettings side by side, interleaved

One session per engine, the default `Sampling()` seeded per reply (the same seeds for every engine, so
every engine speaks the same replies), 1024 text tokens and 100 frames (8 s) per reply, as the server's
tiny demo. Per reply: RTF (respond() to response.done over the audio's seconds), the process's CPU
seconds per audio second, and each stage thread's; and how a player that starts the engine's
`playout_lead_ms` after the first PCM and plays in real time hears it: the share of its span audible
(`audible`) and its longest silence (`gap_ms`), as tests/test_browser.py measures Chromium. Engines run
their replies interleaved, so a neighbour's load on a shared machine falls on all of them alike; compare
ratios within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import threading
import time

import omni_rt

PROMPT = "Hello! Tell me about the sea."


def thread_cpu() -> dict[str, float]:
    """CPU seconds of each live thread of this process, by thread name (Linux /proc)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        name = names.get(int(tid), "other").removeprefix("omni-rt-")
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def played(chunks: list[tuple[float, int]], lead_s: float) -> tuple[float, float]:
    """(share audible, longest silence in s) of a player that starts `lead_s` after the first of
    `chunks` (arrival time, 24 kHz samples) and plays each in real time once it is there."""
    t_play, dry, longest = chunks[0][0] + lead_s, 0.0, 0.0
    for t, n in chunks:
        if t > t_play:
            dry, longest, t_play = dry + t - t_play, max(longest, t - t_play), t
        t_play += n / 24000
    audio = sum(n for _, n in chunks) / 24000
    return audio / (audio + dry), longest


async def reply(engine: omni_rt.Engine, seed: int, frames: int) -> dict[str, float]:
    async with engine.session(sampling=omni_rt.Sampling(seed=seed)) as s:
        before, c0, t0 = thread_cpu(), time.process_time(), time.perf_counter()
        chunks: list[tuple[float, int]] = []
        async for ev in s.respond(PROMPT, max_output_tokens=1024, max_audio_frames=frames):
            if ev.type == "response.output_audio.delta":
                chunks.append((time.perf_counter(), len(ev.pcm)))
        wall, cpu, after = time.perf_counter() - t0, time.process_time() - c0, thread_cpu()
    audio = sum(n for _, n in chunks) / 24000
    audible, gap = played(chunks, (engine.settings.playout_lead_ms or 0) / 1000)
    row = {
        "audio_s": audio,
        "rtf": wall / audio,
        "cpu_per_audio_s": cpu / audio,
        "ttfa_ms": 1000 * (chunks[0][0] - t0),
        "audible": audible,
        "gap_ms": 1000 * gap,
    }
    for stage in ("thinker", "talker", "code2wav"):
        row[f"{stage}_cpu_per_audio_s"] = (after.get(stage, 0.0) - before.get(stage, 0.0)) / audio
    return row


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3, help="replies per engine (default 3)")
    ap.add_argument("--frames", type=int, default=100, help="codec frames per reply (default 100: 8 s)")
    ap.add_argument(
        "--compare", default="{}", help="JSON {label: EngineSettings overrides}, beside the defaults"
    )
    args = ap.parse_args()
    configs = {"served defaults": {}} | json.loads(args.compare)
    engines = {label: omni_rt.Engine.load("tiny", **over) for label, over in configs.items()}
    rows: dict[str, list[dict[str, float]]] = {label: [] for label in engines}
    for e in engines.values():
        await e.start()
    try:
        for i in range(args.reps):
            for label, e in engines.items():
                r = await reply(e, 1000 + i, args.frames)
                rows[label].append(r)
                print(f"{label} #{i}: " + ", ".join(f"{k} {v:.3f}" for k, v in r.items()), flush=True)
    finally:
        for e in engines.values():
            await e.stop()
    print(f"\nmedians over {args.reps} replies, load average {os.getloadavg()[0]:.2f}:")
    for label, rs in rows.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        print(f"  {label}: " + ", ".join(f"{k} {v:.3f}" for k, v in med.items()))


if __name__ == "__main__":
    asyncio.run(main())
