"""`omni-rt say` as a new user runs it (a subprocess), and the lazy serve/bench dispatch."""

import asyncio
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


def test_usage_version_and_unknown_command(capsys):
    assert cli.main([]) == 2
    assert cli.main(["--help"]) == 0
    usage = capsys.readouterr().out
    assert all(f"  {c} " in usage for c in ("say", "serve", "bench")) and len(usage.splitlines()) > 5
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("omni-rt ")
    assert cli.main(["dance"]) == 2
    assert "unknown command" in capsys.readouterr().err


def omni_rt_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "omni_rt.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_a_failed_say_leaves_an_existing_file_as_it_was(tmp_path):
    out = tmp_path / "reply.wav"
    out.write_bytes(b"an earlier reply")
    r = omni_rt_cli("say", "hi", "--out", str(out), "--voice", "nobody", "--max-tokens", "2")
    assert r.returncode == 2 and "unknown voice" in r.stderr
    assert r.stderr.startswith("loading tiny")  # not silent while the model loads
    assert out.read_bytes() == b"an earlier reply"
    assert [p.name for p in tmp_path.iterdir()] == ["reply.wav"]  # no temporary file left behind
    ok = omni_rt_cli("say", "hi", "--out", str(out), "--max-tokens", "2", "--max-frames", "2", "--quiet")
    assert ok.returncode == 0 and out.read_bytes()[:4] == b"RIFF" and not ok.stderr
    assert oct(out.stat().st_mode & 0o777) != oct(0o600)  # as a plain open() makes it, not mkstemp's


def test_cuda_without_cuda_is_a_clear_error(tmp_path):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    r = omni_rt_cli("say", "hi", "--out", str(tmp_path / "x.wav"), "--device", "cuda")
    assert r.returncode == 2 and "CUDA is not available" in r.stderr and "Traceback" not in r.stderr


def test_a_model_too_big_for_memory_is_a_clear_error(monkeypatch):
    from omni_rt import engine as engine_module
    from omni_rt.errors import ConfigError

    monkeypatch.setattr(engine_module, "_available_memory", lambda: 1 << 20)  # 1 MB free
    with pytest.raises(ConfigError, match=r"tiny in float32 needs .* GB .* 0 GB free: use a GPU"):
        engine_module.Engine.load("tiny")


def test_serve_and_bench_errors_are_a_line_not_a_traceback(monkeypatch, capsys):
    from omni_rt.errors import ConfigError

    fake = types.ModuleType("omni_rt.bench")

    def fail(argv):
        raise ConfigError("qwen3-omni-30b-a3b in float32 needs 129 GB")

    fake.main = fail
    monkeypatch.setitem(sys.modules, "omni_rt.bench", fake)
    assert cli.main(["bench"]) == 2
    assert (
        capsys.readouterr().err == "omni-rt bench: ConfigError: qwen3-omni-30b-a3b in float32 needs 129 GB\n"
    )


def test_serve_checks_its_voice_and_port_before_loading_the_model():
    import socket

    r = omni_rt_cli("serve", "--voice", "bob", "--port", "0")
    assert r.returncode == 1 and "unknown voice 'bob'" in r.stderr and "loading" not in r.stdout
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = omni_rt_cli("serve", "--port", str(port))
    assert r.returncode == 1 and "in use" in r.stderr and "loading" not in r.stdout


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


def test_serve_sets_engine_settings_and_checks_them_before_loading(monkeypatch):
    # `--set KEY=VALUE` reaches Engine.load; a bad name or value is a usage error before any loading
    from omni_rt.server import app

    args = app.parse_args(
        ["--set", "stall_timeout_s=20", "--set", "programmatic_launch=true", "--set", "handoff=event"]
    )
    assert args.engine_settings == {"stall_timeout_s": 20, "programmatic_launch": True, "handoff": "event"}
    for bad in (["--set", "no_such=1"], ["--set", "stall_timeout_s=-1"], ["--set", "max_sessions=2"]):
        with pytest.raises(SystemExit) as usage:
            app.parse_args(bad)
        assert usage.value.code == 2, bad
    loaded = {}

    class Stop(Exception):
        pass

    def load(model, **kw):
        loaded.update(kw, model=model)
        raise Stop  # what serve passes is all this test reads

    monkeypatch.setattr("omni_rt.Engine.load", load)
    with pytest.raises(Stop):
        asyncio.run(app.serve_forever(app.parse_args(["--port", "0", "--set", "stall_timeout_s=20"])))
    assert loaded["stall_timeout_s"] == 20 and loaded["max_sessions"] == 4 and loaded["model"] == "tiny"
