"""`omni-rt say` as a new user runs it (a subprocess), and the lazy serve/bench dispatch."""

import subprocess
import sys
import types
import wave
from pathlib import Path

import numpy as np
import pytest

from omni_rt import cli

ROOT = Path(__file__).resolve().parent.parent


def test_say_writes_a_24khz_mono_wav(tmp_path):
    out = tmp_path / "reply.wav"
    r = subprocess.run(
        [sys.executable, "-m", "omni_rt.cli", "say", "Hello there", "--out", str(out),
         "--max-tokens", "6", "--max-frames", "10", "--greedy"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    with wave.open(str(out)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2)
        n = w.getnframes()
        pcm = np.frombuffer(w.readframes(n), dtype="<i2")
    # 10 frames of 1920 samples, less the 555-sample look-ahead of exact streaming
    assert n == 10 * 1920 - 555
    assert np.abs(pcm).max() > 0  # a real waveform, not silence
    assert "ttfa" in r.stdout and "rtf" in r.stdout and f"wrote {out}" in r.stdout


def test_say_reports_bad_input_as_a_typed_error(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "omni_rt.cli", "say", "hi", "--out", str(tmp_path / "x.wav"), "--voice", "nobody"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2
    assert "InvalidRequestError" in r.stderr and "unknown voice" in r.stderr


@pytest.mark.parametrize("command,module", [("serve", "omni_rt.server.app"), ("bench", "omni_rt.bench")])
def test_serve_and_bench_dispatch_lazily(monkeypatch, command, module):
    seen = []
    fake = types.ModuleType(module)
    fake.main = lambda argv: seen.append(list(argv)) or 0
    monkeypatch.setitem(sys.modules, module, fake)
    assert cli.main([command, "--port", "1"]) == 0
    assert seen == [["--port", "1"]]


def test_cli_import_stays_light():
    # importing the CLI (and the SDK) must not pull in torch: `omni-rt --help` answers at once
    code = "import sys, omni_rt.cli, omni_rt; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=60).returncode == 0


def test_usage_and_unknown_command(capsys):
    assert cli.main([]) == 2
    assert cli.main(["--help"]) == 0
    assert cli.main(["dance"]) == 2
    assert "unknown command" in capsys.readouterr().err


def test_say_answers_a_spoken_prompt(tmp_path):
    question, out = tmp_path / "q.wav", tmp_path / "a.wav"
    t = np.arange(48000) / 48000  # one second at 48 kHz (resampled to 16 kHz for the audio encoder)
    with wave.open(str(question), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(48000)
        w.writeframes((0.3 * np.sin(2 * np.pi * 200 * t) * 32767).astype("<i2").tobytes())
    r = subprocess.run(
        [sys.executable, "-m", "omni_rt.cli", "say", "--audio", str(question), "--out", str(out),
         "--max-tokens", "3", "--max-frames", "4", "--greedy"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    with wave.open(str(out)) as w:
        assert w.getnframes() == 4 * 1920 - 555


def test_say_reports_an_unwritable_output_path(tmp_path, capsys):
    assert cli.say(["hi", "--out", str(tmp_path / "missing" / "x.wav"), "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "cannot write" in err and "x.wav" in err
