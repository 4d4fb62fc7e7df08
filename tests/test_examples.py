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
