"""The agent-framework recipes in examples/ run to their first audio, as a user would run them, on tiny."""

from __future__ import annotations

import os
import subprocess
import sys
import wave
from pathlib import Path

import pytest
from integrations_support import spoken

ROOT = Path(__file__).resolve().parent.parent


def speech_wav(path: Path) -> Path:
    pcm, rate = spoken("Good morning to you")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return path


@pytest.mark.parametrize("script", ["pipecat_bot.py", "livekit_agent.py"])
def test_example_runs_to_its_first_audio(script: str, tmp_path: Path) -> None:
    wav = speech_wav(tmp_path / "hello.wav")
    env = os.environ | {"PYTHONPATH": str(ROOT)}  # this checkout's omni_rt, whatever is installed
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), str(wav), "--until-first-audio"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "first audio: " in out.stdout and "at 24000 Hz" in out.stdout, out.stdout
