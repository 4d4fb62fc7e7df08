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
