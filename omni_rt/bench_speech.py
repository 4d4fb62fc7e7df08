"""`omni-rt bench --speech-turn`: a spoken question, fed in real time through the server's own path.

    omni-rt bench --rows none --speech-turn                        # H200, real shapes (random weights)
    omni-rt bench --preset tiny --device cpu --rows none --speech-turn --speech-seconds 1 --speech-requests 1

An in-process server (`omni_rt.server.Server`, the `/ws` socket on loopback) gets, per request, a new
connection and 0.5 s of silence, the question (espeak-ng saying a ~5 s question when it is on PATH,
else `bench_load.spoken_turn`'s speech-like signal, `--speech-seconds` long) and silence after it, in
20 ms `input_audio_buffer.append` pieces paced in real time, as a microphone sends them. Server VAD or
semantic_vad ends the turn and the reply starts; the client reads the events. Per request:

- end of turn -> first audio: from the client's receipt of `input_audio_buffer.speech_stopped` (the
  server's end of turn) to its first `response.output_audio.delta`. What encoding while speaking and the
  speculative start save shows here: with both, the turn's end leaves only the release (or the last
  encoder window and the prefill).
- voice_to_voice_ms: the server's figure in `response.done` (end of speech, dated by when its audio
  arrived, to the first audio sent), and the client's own (from sending the piece where the voice ended
  to receiving the first audio).
- text-turn TTFA: the same server and prompt path for a text question (`conversation.item.create`,
  `response.create` -> first audio), the figure the spoken rows are held to (+ 15 ms, issue 12).

Rows: the text turn; server_vad with everything on; speculative start off; encoding while speaking off
too; semantic_vad (auto) with everything on. Replies are `--text-tokens` / `--frames` long at most.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import wave
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["format_speech_table", "question_audio", "run_speech_rows", "smart_turn_heard", "speech_row_plan"]

RATE = 24000  # what the socket takes
PIECE_MS = 20
LEAD_S, TAIL_S = 0.5, 5.0  # silence before the question and after it (semantic_vad's longest wait: 4 s)
QUESTION = "Could you tell me what the weather will be like in Paris tomorrow afternoon, please?"
TEXT_QUESTION = "What will the weather be like in Paris tomorrow?"


def speech_row_plan() -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(row, engine settings over all on, turn_detection) of each spoken row."""
    return [
        ("spoken, server_vad (all on)", {}, {"type": "server_vad"}),
        (
            "spoken, server_vad, no speculative start",
            {},
            {"type": "server_vad", "speculative_response": False},
        ),
        (
            "spoken, server_vad, no speculation, no encoding while speaking",
            {"encode_while_speaking": False},
            {"type": "server_vad", "speculative_response": False},
        ),
        ("spoken, semantic_vad auto (all on)", {}, {"type": "semantic_vad", "eagerness": "auto"}),
    ]


def _read_wav(path: str | Path) -> tuple[np.ndarray, int]:
    with wave.open(str(path), "rb") as w:
        if w.getsampwidth() != 2 or w.getnchannels() != 1:
            raise SystemExit(f"{path}: the spoken question must be a mono 16-bit WAV")
        rate = w.getframerate()
        return np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16).astype(np.float32) / 32768, rate


def _voice_only(pcm: np.ndarray, rate: int) -> np.ndarray:
    """At 24 kHz, trimmed to the voice (its end is the end of speech) and peak-normalised to 0.7."""
    from omni_rt.audio.resample import resample

    x = resample(pcm, rate, RATE).astype(np.float32)
    loud = np.flatnonzero(np.abs(x) > 0.01)
    if not len(loud):
        raise SystemExit("the spoken question is silent")
    x = x[loud[0] : loud[-1] + 1]
    return (x * (0.7 / np.max(np.abs(x)))).astype(np.float32)


def question_audio(seconds: float, seed: int, wav: str | None = None) -> tuple[np.ndarray, str]:
    """(24 kHz float32 of the spoken question, where it came from): the recording `wav` when given, else
    espeak-ng when it is installed (the question at the speaking rate that makes it about `seconds`
    long), else the speech-like signal."""
    if wav is not None:
        return _voice_only(*_read_wav(wav)), f"recording {Path(wav).name}"
    if shutil.which("espeak-ng"):
        wpm = max(80, min(400, round(len(QUESTION.split()) / seconds * 60)))
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "q.wav"
            subprocess.run(
                ["espeak-ng", "-v", "en-us", "-s", str(wpm), "-w", str(path), QUESTION],
                check=True,
                capture_output=True,
            )
            pcm, rate = _read_wav(path)
        return _voice_only(pcm, rate), f"espeak-ng, {wpm} wpm"
    from omni_rt.bench_load import spoken_turn

    return spoken_turn(seconds, RATE, seed=seed), "speech-like signal (bench_load.spoken_turn)"


def _b64(audio: np.ndarray) -> str:
    return base64.b64encode((np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()).decode()


async def _recv_until(ws: Any, want: str, seen: dict[str, float], events: list) -> dict:
    """Read events (noting when each type first came) up to the first `want`."""
    while True:
        ev = json.loads(await asyncio.wait_for(ws.recv(), 120))
        seen.setdefault(ev["type"], time.perf_counter())
        events.append(ev)
        if ev["type"] == want:
            return ev


async def _connect(port: int, detection: dict[str, Any] | None, max_tokens: int) -> Any:
    import websockets

    ws = await websockets.connect(f"ws://127.0.0.1:{port}/ws", max_size=None)
    await _recv_until(ws, "session.created", {}, [])
    session: dict[str, Any] = {"max_output_tokens": max_tokens}
    if detection is not None:
        session["turn_detection"] = detection
    await ws.send(json.dumps({"type": "session.update", "session": session}))
    while (ev := json.loads(await asyncio.wait_for(ws.recv(), 120)))["type"] != "session.updated":
        if ev["type"] == "error":  # e.g. semantic_vad without its model file: say why, wait for nothing
            await ws.close()
            raise RuntimeError(f"the server refused the bench's session.update: {ev['error']}")
    return ws


async def _spoken_request(port: int, detection: dict[str, Any], audio: np.ndarray, max_tokens: int) -> dict:
    ws = await _connect(port, detection, max_tokens)
    seen: dict[str, float] = {}
    events: list = []
    clip = np.concatenate(
        [np.zeros(int(LEAD_S * RATE), np.float32), audio, np.zeros(int(TAIL_S * RATE), np.float32)]
    )
    n = RATE * PIECE_MS // 1000
    voice_end = int(LEAD_S * RATE) + len(audio)  # the sample where the voice ends
    reader = asyncio.create_task(_recv_until(ws, "response.done", seen, events))
    t_voice_end = None
    t0 = time.perf_counter()
    try:
        for k, i in enumerate(range(0, len(clip), n)):
            # paced by the clock, as a microphone is: piece k goes out at k * 20 ms
            await asyncio.sleep(max(0.0, t0 + k * PIECE_MS / 1000 - time.perf_counter()))
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": _b64(clip[i : i + n])}))
            if t_voice_end is None and i + n >= voice_end:
                t_voice_end = time.perf_counter()
            if reader.done():
                break
        done = await reader
    finally:
        reader.cancel()
        await ws.close()
    metrics = done["response"].get("metrics") or {}
    first = seen.get("response.output_audio.delta")
    stopped = seen.get("input_audio_buffer.speech_stopped")
    return {
        "end_of_turn_to_first_audio_ms": None
        if first is None or stopped is None
        else 1000 * (first - stopped),
        "voice_to_voice_ms": metrics.get("voice_to_voice_ms"),
        "client_voice_to_voice_ms": None if first is None else 1000 * (first - t_voice_end),
        "end_of_speech_ms": metrics.get("end_of_speech_ms"),
        "held_ms": metrics.get("held_ms"),
        "ttfa_ms": metrics.get("ttfa_ms"),
        "status": done["response"]["status"],
        "turns": sum(e["type"] == "input_audio_buffer.committed" for e in events),
    }


async def _text_request(port: int, max_tokens: int) -> dict:
    ws = await _connect(port, None, max_tokens)
    seen: dict[str, float] = {}
    try:
        item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": TEXT_QUESTION}]}
        await ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
        t0 = time.perf_counter()
        await ws.send(json.dumps({"type": "response.create"}))
        done = await _recv_until(ws, "response.done", seen, [])
    finally:
        await ws.close()
    first = seen.get("response.output_audio.delta")
    return {"ttfa_ms": None if first is None else 1000 * (first - t0), "status": done["response"]["status"]}


def _median(samples: list[dict], key: str) -> float | None:
    vals = [s[key] for s in samples if s.get(key) is not None]
    return statistics.median(vals) if vals else None


async def _rows_on(engine: Any, args: argparse.Namespace, plan: list, audio: np.ndarray) -> list[dict]:
    try:
        from omni_rt.server import PeerSettings, Server, ServerSettings
    except ImportError as exc:
        raise SystemExit(f"--speech-turn runs the server: install the `server` extra ({exc})") from None

    peer = PeerSettings(max_output_tokens=args.text_tokens, max_audio_frames=args.frames)
    rows = []
    async with engine, Server(engine, ServerSettings(port=0, peer=peer)) as server:
        for name, detection in plan:
            samples = []
            for r in range(args.speech_warmup + args.speech_requests):
                if detection is None:
                    s = await _text_request(server.port, args.text_tokens)
                else:
                    s = await _spoken_request(server.port, detection, audio, args.text_tokens)
                if r >= args.speech_warmup:
                    samples.append(s)
            keys = ("ttfa_ms",) if detection is None else (
                "end_of_turn_to_first_audio_ms", "voice_to_voice_ms", "client_voice_to_voice_ms",
                "end_of_speech_ms", "held_ms", "ttfa_ms",
            )  # fmt: skip
            row = {"row": name, "requests": len(samples), "samples": samples}
            row |= {f"median_{k}": _median(samples, k) for k in keys}
            print(f"[bench] {name}: {_brief(row)}", file=sys.stderr, flush=True)
            rows.append(row)
    return rows


def _brief(row: dict) -> str:
    return ", ".join(
        f"{k.removeprefix('median_')} {v:.1f}"
        for k, v in row.items()
        if k.startswith("median_") and v is not None
    )


def run_speech_rows(args: argparse.Namespace, make_engine: Any, plan: list | None = None) -> list[dict]:
    """The text-turn row and the spoken rows of `plan` (default: `speech_row_plan()`); `make_engine(
    overrides)` gives an engine with every optimisation on but for `overrides`."""
    audio, source = question_audio(args.speech_seconds, args.seed, getattr(args, "speech_wav", None))
    print(f"[bench] spoken question: {len(audio) / RATE:.2f} s, {source}", file=sys.stderr, flush=True)
    spoken = speech_row_plan() if plan is None else plan
    heard = smart_turn_heard(audio, spoken)
    by_engine: dict[str, tuple[dict, list]] = {}
    by_engine["{}"] = ({}, [("text turn (all on)", None)])
    for name, overrides, detection in spoken:
        by_engine.setdefault(json.dumps(overrides, sort_keys=True), (overrides, []))[1].append(
            (name, detection)
        )
    rows = []
    for overrides, plan in by_engine.values():
        rows += asyncio.run(_rows_on(make_engine(overrides), args, plan, audio))
    text = next(r["median_ttfa_ms"] for r in rows if r["row"].startswith("text turn"))
    for r in rows:
        r["question_seconds"], r["question_source"] = len(audio) / RATE, source
        eot = r.get("median_end_of_turn_to_first_audio_ms")
        if eot is not None and text is not None:
            r["end_of_turn_vs_text_ttfa_ms"] = eot - text  # issue 12: <= 15 ms with everything on
        r |= heard.get(r["row"], {})
    return rows


def smart_turn_heard(audio: np.ndarray, plan: list) -> dict[str, dict[str, Any]]:
    """Per semantic_vad row: Smart Turn's probability that the question is finished, heard as the
    detector hears it after the last word (the voice at 16 kHz), and what its eagerness needs. Below
    that, the row's figures are the eagerness' longest wait, not the engine (docs/turn-taking.md)."""
    rows = {name: d for name, _, d in plan if d is not None and d.get("type") == "semantic_vad"}
    if not rows:
        return {}
    from omni_rt.audio.resample import resample
    from omni_rt.audio.semantic import EAGERNESS, SmartTurn

    p = SmartTurn()(resample(audio, RATE, 16000).astype(np.float32))
    heard = {}
    for name, detection in rows.items():
        need, wait = EAGERNESS[detection.get("eagerness", "auto")]
        heard[name] = {"smart_turn_probability": p, "completion_threshold": need, "max_wait_ms": wait}
        verdict = "finished" if p >= need else f"unfinished: the turn ends at the {wait} ms wait"
        print(
            f"[bench] {name}: Smart Turn hears the question {verdict} ({p:.2f}, needs {need})",
            file=sys.stderr,
        )
    return heard


def format_speech_table(rows: list[dict]) -> str:
    cols = [
        ("end of turn->audio", "median_end_of_turn_to_first_audio_ms"),
        ("vs text TTFA", "end_of_turn_vs_text_ttfa_ms"),
        ("voice_to_voice", "median_voice_to_voice_ms"),
        ("client v2v", "median_client_voice_to_voice_ms"),
        ("held", "median_held_ms"),
        ("TTFA", "median_ttfa_ms"),
    ]
    width = max(len(r["row"]) for r in rows)
    head = f"{'speech row (ms, medians)':<{width}} " + " ".join(f"{c:>18}" for c, _ in cols)
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = " ".join(f"{'-' if r.get(k) is None else f'{r[k]:.1f}':>18}" for _, k in cols)
        lines.append(f"{r['row']:<{width}} {cells}")
    return "\n".join(lines)
