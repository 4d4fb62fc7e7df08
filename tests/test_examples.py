"""The embedding recipes in examples/ run as a user would run them, on the tiny preset."""

import subprocess
import sys
import wave
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run(script: str, *args: str, cwd: Path) -> str:
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_say_writes_the_streamed_reply_to_a_wav(tmp_path: Path) -> None:
    stdout = run("say.py", "Hello there", "reply.wav", cwd=tmp_path)
    assert "completed: first audio after" in stdout
    with wave.open(str(tmp_path / "reply.wav")) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 24000)
        assert w.getnframes() > 24000 // 2  # 48 frames of 80 ms were asked for; at least half a second


def test_voice_agent_answers_a_turn_and_is_interrupted_by_the_next(tmp_path: Path) -> None:
    lines = run("voice_agent.py", cwd=tmp_path).splitlines()
    # turn 1 is answered, the user talks over the reply while it plays (barge-in), turn 2 is answered in
    # full; whether turn 1's generation was still running (cancelled) or only its playback depends on speed
    assert [ln.split()[0] for ln in lines] == ["[turn", "[reply", "[barge-in", "[turn", "[reply"]
    assert ("cancelled" in lines[1] or "completed" in lines[1]) and "completed" in lines[4]


def test_the_readme_embed_snippet_runs_as_written(tmp_path: Path) -> None:
    readme = (EXAMPLES.parent / "README.md").read_text()
    section = readme[readme.index("## Embed it") :]
    start = section.index("```python\n") + len("```python\n")
    snippet = section[start : section.index("\n```", start)]
    (tmp_path / "embed.py").write_text(snippet)
    out = subprocess.run(
        [sys.executable, "embed.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    last = out.stdout.splitlines()[-1]
    assert last.startswith("completed, first audio after ")  # on its own line, after the text
    with wave.open(str(tmp_path / "reply.wav")) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 24000)
        assert w.getnframes() > 0


def test_the_webrtc_example_serves_on_the_port_asked_for(tmp_path: Path) -> None:
    import json
    import urllib.request

    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLES / "webrtc_server.py"), "--port", "0"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        line = proc.stdout.readline()  # "open http://127.0.0.1:PORT/?token=..." once it serves
        assert line.startswith("open http://127.0.0.1:"), line + proc.stderr.read()
        port = int(line.split(":")[2].split("/")[0])
        assert port != 8080
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
            assert json.loads(r.read())["ok"] is True
    finally:
        proc.terminate()
        proc.wait(30)
