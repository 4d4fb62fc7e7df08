"""`omni-rt`: say | serve | bench.

    omni-rt say "Hello there" --out reply.wav [--model tiny|DIR|preset] [--voice ethan]
    omni-rt say --audio question.wav --out reply.wav        (a spoken prompt: mono 16-bit WAV)

`say` streams one response into a 24 kHz mono 16-bit WAV (or the rate asked for), printing a progress
line while it works and the response's metrics at the end; the file is written only when the response
completes (a temporary file renamed over it), so a failed run leaves an existing file as it was. `serve` and `bench` belong to the server and
the benchmark; they are imported only when asked for, so `say` stays light.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
import wave
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

USAGE = """usage: omni-rt [--version] <command> [options]   (omni-rt <command> --help for each)

Real-time Qwen3-Omni speech: the Thinker writes the reply, the Talker and Code2Wav speak it as it goes.

commands:
  say     speak one reply to TEXT (or a spoken --audio WAV) into a WAV file
            omni-rt say "Tell me a story" --out reply.wav
  serve   the demo page and realtime sessions (WebRTC, WebSocket) on one port
            omni-rt serve --port 8080        then open http://127.0.0.1:8080/
  bench   the benchmark protocol: a table, bench.json and bench.png (a CUDA GPU for the real model)
            omni-rt bench --preset tiny --device cpu

say and serve run the 'tiny' preset (seeded random weights, on the CPU) unless given --model DIR."""


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("omni-rt")
    except PackageNotFoundError:  # a source checkout that was never installed
        return "unknown (not installed)"


def _say_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="omni-rt say", description="Speak a reply to TEXT into a WAV file.")
    p.add_argument("text", nargs="?", default=None, help="what to say to the model (text)")
    p.add_argument("--audio", default=None, help="a spoken prompt: a mono 16-bit WAV at 16, 24 or 48 kHz")
    p.add_argument("--out", "-o", default="reply.wav", help="output WAV path (default: reply.wav)")
    p.add_argument(
        "--model", "-m", default="tiny", help="preset name or checkpoint directory (default: tiny)"
    )
    p.add_argument("--voice", default="ethan", help="speaker: ethan, chelsie, aiden (default: ethan)")
    p.add_argument("--instructions", default=None, help="system prompt")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="float32 (CPU default), bfloat16 (GPU default), ...")
    p.add_argument(
        "--random-weights", action="store_true", help="seeded random weights at the model's shapes"
    )
    p.add_argument("--sample-rate", type=int, default=24000, choices=(24000, 48000, 16000))
    p.add_argument(
        "--max-tokens", type=int, default=None, help="text tokens (default: 32 on tiny, else 1024)"
    )
    p.add_argument(
        "--max-frames", type=int, default=None, help="codec frames, 80 ms each (default: 48 on tiny)"
    )
    p.add_argument("--greedy", action="store_true", help="greedy decoding in every stage")
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress line")
    return p


async def _say(args: argparse.Namespace) -> int:
    from omni_rt.errors import InvalidRequestError

    # The reply goes to a temporary file beside --out, renamed over it only when the response completes:
    # a failed run leaves an existing file as it was. Opened before the model loads: a bad path fails
    # at once, not after minutes of loading.
    target = Path(args.out)
    if target.is_dir():
        raise InvalidRequestError(f"cannot write {args.out}: it is a directory")
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent)
    except OSError as e:
        raise InvalidRequestError(f"cannot write {args.out}: {e.strerror or e}") from None
    tmp = Path(tmp_name)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(fd, 0o666 & ~umask)  # as open() would have made it (mkstemp's are private)
    try:
        with os.fdopen(fd, "wb") as out:
            ok = await _say_into(args, out)
        if ok:
            os.replace(tmp, target)
        return 0 if ok else 1
    finally:
        tmp.unlink(missing_ok=True)


async def _say_into(args: argparse.Namespace, out: BinaryIO) -> bool:
    import numpy as np

    import omni_rt

    if not args.quiet:
        print(f"loading {args.model} ...", file=sys.stderr, flush=True)
    t_load = time.perf_counter()
    engine = omni_rt.Engine.load(
        args.model, device=args.device, dtype=args.dtype, random_weights=args.random_weights
    )
    load_s = time.perf_counter() - t_load
    tiny = args.model == "tiny"  # random weights never stop on their own: keep the default reply short
    max_tokens = args.max_tokens or (32 if tiny else 1024)
    max_frames = args.max_frames or (48 if tiny else 4096)
    sampling = omni_rt.Sampling.greedy(args.seed) if args.greedy else omni_rt.Sampling(seed=args.seed)
    spoken = (
        {}
        if args.audio is None
        else dict(zip(("audio", "audio_sample_rate"), _read_wav(args.audio), strict=True))
    )
    text, samples, done = [], 0, None
    progress = not args.quiet and sys.stderr.isatty()
    with wave.open(out, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(args.sample_rate)
        async with engine:
            async with engine.session(
                voice=args.voice, instructions=args.instructions, output_sample_rate=args.sample_rate
            ) as s:
                async for ev in s.respond(
                    args.text,
                    max_output_tokens=max_tokens,
                    max_audio_frames=max_frames,
                    sampling=sampling,
                    **spoken,
                ):
                    if ev.type == "response.output_text.delta":
                        text.append(ev.delta)
                    elif ev.type == "response.output_audio.delta":
                        wav.writeframes(np.asarray(ev.pcm, dtype="<i2").tobytes())
                        samples += len(ev.pcm)
                    elif ev.type == "error":
                        print(f"error: {ev.error.message}", file=sys.stderr)
                    elif ev.type == "response.done":
                        done = ev
                    if progress:
                        print(
                            f"\r{len(text)} tokens, {samples / args.sample_rate:5.2f} s of audio",
                            end="",
                            file=sys.stderr,
                            flush=True,
                        )
    if progress:
        print(file=sys.stderr)
    if done is None or done.status != "completed":
        print(f"response {done.status if done else 'lost'}: {args.out} left as it was", file=sys.stderr)
        return False
    m = done.metrics
    print(f"text: {''.join(text)!r}")
    print(f"wrote {args.out}: {samples / args.sample_rate:.2f} s, {args.sample_rate} Hz mono 16-bit")

    def fmt(v: float | None, unit: str = "ms") -> str:
        return "-" if v is None else f"{v:.1f} {unit}"

    print(
        f"model {args.model} loaded in {load_s:.1f} s | ttft {fmt(m.ttft_ms)} | ttfa {fmt(m.ttfa_ms)} | "
        f"thinker first token {fmt(m.thinker_first_token_ms)} | talker first code "
        f"{fmt(m.talker_first_code_ms)} | first pcm {fmt(m.first_pcm_ms)} | "
        f"{fmt(m.text_tokens_per_s, 'tok/s')} | audio {m.audio_seconds:.2f} s | rtf {fmt(m.rtf, '')}"
    )
    return True


def _read_wav(path: str):
    """(int16 mono PCM, sample rate) of a 16-bit WAV file."""
    import numpy as np

    from omni_rt.errors import InvalidRequestError

    try:
        with wave.open(path, "rb") as w:
            if w.getsampwidth() != 2 or w.getnchannels() != 1:
                raise InvalidRequestError(
                    f"{path}: need mono 16-bit PCM, got {w.getnchannels()} ch, {8 * w.getsampwidth()} bit"
                )
            return np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.int16), w.getframerate()
    except (OSError, wave.Error) as e:
        raise InvalidRequestError(f"cannot read {path}: {e}") from None


def say(argv: Sequence[str]) -> int:
    from omni_rt.errors import OmniRtError

    parser = _say_parser()
    args = parser.parse_args(list(argv))
    if args.text is None and args.audio is None:
        parser.error("give TEXT, --audio WAV, or both")
    try:
        return asyncio.run(_say(args))
    except OmniRtError as e:
        print(f"omni-rt say: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(f"omni-rt {version()}")
        return 0
    command, rest = argv[0], argv[1:]
    if command == "say":
        return say(rest)
    if command not in ("serve", "bench"):
        print(f"omni-rt: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    from omni_rt.errors import OmniRtError

    try:
        if command == "serve" and "--ray" in rest:  # across a Ray cluster: omni_rt.cluster (the `ray` extra)
            from omni_rt.cluster.launch import main as ray_main

            return ray_main([a for a in rest if a != "--ray"])
        if command == "serve":
            from omni_rt.server.app import main as serve_main  # imported only when asked for

            return serve_main(rest) or 0
        from omni_rt.bench import main as bench_main

        return bench_main(rest) or 0
    except OmniRtError as e:  # a bad model, device or setting: a line, not a traceback
        print(f"omni-rt {command}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
