"""Three minutes of scripts/soak.py, as CI runs it: conversations on tiny through the server on loopback
(text and spoken turns, barge-ins, disconnects). Deselect with `-m "not soak"`."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.soak
def test_three_minutes_of_soak_leave_nothing_stuck_or_behind(tmp_path):
    out = tmp_path / "soak.json"
    r = subprocess.run(
        [sys.executable, "scripts/soak.py", "--minutes", "3", "--conversations", "2", "--check",
         "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=420,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["stuck"] == [] and report["failures"] == []
    assert (report["left_sessions"], report["left_slots"], report["left_tasks"]) == (0, 0, 0)
    assert report["rss_growth_mb"] < 50
    statuses = report["statuses"]

    # every kind of turn happened, and every reply ended as it should
    def finished(action: str) -> int:  # ran to its end: completed, or stopped at its token limit
        return statuses.get(f"{action}:completed", 0) + statuses.get(
            f"{action}:incomplete:max_output_tokens", 0
        )

    assert finished("text") > 0 and finished("speech") > 0
    assert not [k for k in statuses if ":incomplete" in k and not k.endswith(":max_output_tokens")]
    assert statuses.get("barge-in:cancelled", 0) + statuses.get("barge-in:completed", 0) > 0
    assert statuses.get("disconnect:dropped", 0) > 0
    assert not [k for k in statuses if k.endswith(":failed")], report["error_messages"]
    assert len(report["samples"]) >= 10
