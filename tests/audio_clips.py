"""The clip set the turn-taking tests listen to, made on the spot: espeak-ng speech and synthetic noise.

    speech("What time is it?")          # 16 kHz float32, espeak-ng's voice, peak-normalised to -3 dBFS
    hum(ms), fan(ms), white(ms), chords(ms)   # non-speech at -30 dBFS RMS (default)
    over_noise(speech, noise_fn, snr_db=10)   # speech mixed into noise at a given SNR
    silence(ms)

Everything is deterministic (seeded noise, espeak-ng's fixed voice), so a test that fails fails again.
Tests that need speech skip when espeak-ng is missing (scripts/setup.sh test installs it).
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import tempfile
import wave
from pathlib import Path

import numpy as np
import pytest

from omni_rt.audio.resample import resample

SR = 16000


def have_espeak() -> bool:
    return shutil.which("espeak-ng") is not None


needs_espeak = pytest.mark.skipif(not have_espeak(), reason="espeak-ng is not installed")


@functools.lru_cache(maxsize=64)
def _espeak(text: str, rate_wpm: int) -> np.ndarray:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "say.wav"
        subprocess.run(  # -m: SSML, so `<break time="400ms"/>` pauses inside one sentence's intonation
            ["espeak-ng", "-m", "-v", "en-us", "-s", str(rate_wpm), "-w", str(path), text],
            check=True,
            capture_output=True,
        )
        with wave.open(str(path), "rb") as w:
            rate = w.getframerate()
            pcm = np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16)
    x = resample(pcm.astype(np.float32) / 32768.0, rate, SR).astype(np.float32)
    # espeak-ng pads its output with silence: keep the voice only, so times in a test are the speech's
    loud = np.flatnonzero(np.abs(x) > 0.01)
    x = x[loud[0] : loud[-1] + 1]
    return (x * (10 ** (-3 / 20) / np.max(np.abs(x)))).astype(np.float32)


def speech(text: str, rate_wpm: int = 165) -> np.ndarray:
    """espeak-ng saying `text` (SSML allowed), trimmed to the voice (no leading or trailing silence)."""
    return _espeak(text, rate_wpm).copy()


def n(ms: int) -> int:
    return ms * SR // 1000


def _at_dbfs(x: np.ndarray, dbfs: float) -> np.ndarray:
    rms = float(np.sqrt(np.mean(x.astype(np.float64) ** 2)))
    return (x * (10 ** (dbfs / 20) / rms)).astype(np.float32)


def silence(ms: int) -> np.ndarray:
    return np.zeros(n(ms), np.float32)


def hum(ms: int, dbfs: float = -30.0, hz: float = 50.0) -> np.ndarray:
    """Mains hum: 50 Hz with the odd harmonics a transformer adds."""
    t = np.arange(n(ms)) / SR
    x = sum(a * np.sin(2 * np.pi * hz * k * t) for k, a in ((1, 1.0), (3, 0.4), (5, 0.2), (7, 0.1)))
    return _at_dbfs(x, dbfs)


def white(ms: int, dbfs: float = -30.0, seed: int = 0) -> np.ndarray:
    return _at_dbfs(np.random.default_rng(seed).standard_normal(n(ms)), dbfs)


def fan(ms: int, dbfs: float = -30.0, seed: int = 1) -> np.ndarray:
    """A fan: brown-ish broadband noise (most energy low) plus its blade-pass tone and harmonic."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(n(ms))
    spec = np.fft.rfft(w)
    f = np.fft.rfftfreq(len(w), 1 / SR)
    spec /= np.maximum(f, 20.0) ** 0.8  # -4.8 dB/octave: the rumble of moving air
    broad = np.fft.irfft(spec, len(w))
    t = np.arange(len(w)) / SR
    blade = np.sin(2 * np.pi * 120 * t) + 0.5 * np.sin(2 * np.pi * 240 * t)
    broad /= np.std(broad)
    return _at_dbfs(broad + 0.3 * blade, dbfs)


def chords(ms: int, dbfs: float = -30.0) -> np.ndarray:
    """Music-like: triads of harmonic tones, a new chord every 500 ms, each with an attack and decay."""
    t_chord = np.arange(n(500)) / SR
    env = np.minimum(t_chord / 0.02, 1.0) * np.exp(-t_chord * 2.0)
    roots = (220.0, 174.6, 261.6, 196.0)  # A, F, C, G
    pieces = []
    for i in range(-(-ms // 500)):
        root = roots[i % len(roots)]
        tone = np.zeros_like(t_chord)
        for ratio in (1.0, 1.26, 1.5):  # a major triad
            for h, a in ((1, 1.0), (2, 0.5), (3, 0.25), (4, 0.12)):
                tone += a * np.sin(2 * np.pi * root * ratio * h * t_chord)
        pieces.append(tone * env)
    return _at_dbfs(np.concatenate(pieces)[: n(ms)], dbfs)


def over_noise(voice: np.ndarray, noise: np.ndarray, snr_db: float = 10.0) -> np.ndarray:
    """`voice` mixed into `noise` (same length or longer, voice placed at its start) at `snr_db`."""
    v_rms = float(np.sqrt(np.mean(voice.astype(np.float64) ** 2)))
    n_rms = float(np.sqrt(np.mean(noise[: len(voice)].astype(np.float64) ** 2)))
    out = noise.astype(np.float32).copy()
    out[: len(voice)] += voice * (n_rms * 10 ** (snr_db / 20) / v_rms)
    return out


def cat(*parts: np.ndarray) -> np.ndarray:
    return np.concatenate(parts).astype(np.float32)
