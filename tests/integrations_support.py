"""Shared by the framework-integration tests: one tiny engine per test run (each test starts and stops it),
and spoken test audio: espeak-ng speech as int16 PCM, made on the spot."""

from __future__ import annotations

import functools
import shutil
import subprocess
import tempfile
import wave
from pathlib import Path

import numpy as np


@functools.cache
def tiny_engine():
    """The tiny preset, loaded once for all the integration test files (loading takes seconds)."""
    import omni_rt

    return omni_rt.Engine.load("tiny")


def spoken(text: str) -> tuple[np.ndarray, int]:
    """espeak-ng saying `text`: (mono int16 PCM, its sample rate, 22050 Hz)."""
    if shutil.which("espeak-ng") is None:
        raise RuntimeError("espeak-ng is not installed: `apt-get install espeak-ng` (scripts/setup.sh test)")
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "speech.wav"
        subprocess.run(["espeak-ng", "-w", str(path), text], check=True, capture_output=True, timeout=60)
        with wave.open(str(path)) as w:
            assert (w.getnchannels(), w.getsampwidth()) == (1, 2)
            return np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").copy(), w.getframerate()


def silence(seconds: float, rate: int) -> np.ndarray:
    return np.zeros(int(seconds * rate), np.int16)


def chunks(pcm: np.ndarray, rate: int, ms: int = 20) -> list[np.ndarray]:
    """`pcm` cut in `ms` pieces, as a transport delivers microphone audio."""
    n = rate * ms // 1000
    return [pcm[i : i + n] for i in range(0, len(pcm), n)]


def scripted_engine(*replies: list[int]):
    """An engine of the tiny preset's config and tokenizer whose Thinker says `replies` (token ids), one
    per reply in order, the last one again after them; fake Talker and Code2Wav stages speak each text
    token as one codec frame. No torch: a tool call is a script here, never a sample of random weights.
    `engine.prompts` holds each reply's prompt ids."""
    import omni_rt
    from omni_rt.model.config import preset
    from omni_rt.pipeline.fake import FakeCode2Wav, FakeTalker, FakeThinker, FakeTimings
    from omni_rt.tokenizer import Tokenizer

    cfg = preset("tiny")
    timings = FakeTimings(thinker_prefill=0.001, thinker_decode=0.001, talker_prefix=0.001)
    prompts: list[list[int]] = []
    scripts: dict[str, list[int]] = {}

    class Thinker(FakeThinker):
        def _token(self, req, i: int) -> int:
            if req.id not in scripts:
                prompts.append(list(req.prompt_ids))
                scripts[req.id] = [*replies[min(len(scripts), len(replies) - 1)], cfg.ids.im_end]
            script = scripts[req.id]
            return script[min(i, len(script) - 1)]

    def stages(settings):
        return Thinker(timings, cfg.ids), FakeTalker(timings, cfg.ids), FakeCode2Wav(timings)

    engine = omni_rt.Engine(cfg, Tokenizer.tiny(cfg.ids), stages, omni_rt.EngineSettings(), name="scripted")
    engine.prompts = prompts
    return engine
