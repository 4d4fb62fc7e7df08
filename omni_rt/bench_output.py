"""The benchmark's output: the protocol table and chart, the JSON file, the commit it names, the checks'
lines, and the exit on a stalled engine (`omni_rt.bench` runs the protocol and calls these)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def fmt(s: dict[str, float] | None, digits: int = 1) -> str:
    if not s:
        return "-"
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def format_table(rows: list[dict[str, Any]]) -> str:
    """The protocol rows; `yield->audio`: the fraction of the Thinker's yields that ended on first audio."""
    head = (
        f"{'row':42} {'sampling':>16} {'n':>3} {'TTFT ms':>22} {'TTFA ms':>22} {'text tok/s':>20} {'RTF':>20} "
        f"{'thinker 1st':>11} {'talker 1st':>10} {'first PCM':>9} {'yield->audio':>12}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        if r.get("skipped"):
            lines.append(f"{r['row']:42} skipped: {r['skipped']}")
            continue
        st = (r.get("median_request") or {}).get("stages") or {}

        def ms(k: str, st: dict = st) -> str:
            v = st.get(k)
            return "-" if v is None else f"{v:.1f}"

        frac = (r.get("thinker_yield") or {}).get("fraction_first_audio")
        lines.append(
            f"{r['row']:42} {r.get('sampling', '-'):>16} {r['requests']:>3} {fmt(r['ttft_ms']):>22} "
            f"{fmt(r['ttfa_ms']):>22} {fmt(r['text_tok_s']):>20} {fmt(r['rtf'], 3):>20} "
            f"{ms('thinker_first_token_ms'):>11} {ms('talker_first_code_ms'):>10} {ms('first_pcm_ms'):>9} "
            f"{'-' if frac is None else f'{100 * frac:.0f} %':>12}"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if not r.get("skipped") and r.get("ttfa_ms")]
    if not rows:
        return
    names = [r["row"] for r in rows]
    fig, axes = plt.subplots(2, 2, figsize=(14, 9))
    for ax, (key, label, log) in zip(
        axes.flat,
        [
            ("ttfa_ms", "TTFA, ms (median, min-max)", True),
            ("ttft_ms", "TTFT, ms", True),
            ("text_tok_s", "Thinker text tokens/s", False),
            ("rtf", "RTF (lower is better)", True),
        ],
        strict=True,
    ):
        med = [(r[key] or {}).get("median", float("nan")) for r in rows]
        lo = [m - (r[key] or {}).get("min", m) for m, r in zip(med, rows, strict=True)]
        hi = [(r[key] or {}).get("max", m) - m for m, r in zip(med, rows, strict=True)]
        ax.barh(range(len(rows)), med, xerr=[lo, hi], color="tab:blue", alpha=0.8)
        ax.set_yticks(range(len(rows)), names, fontsize=8)
        ax.invert_yaxis()
        ax.set_title(label)
        if log and all(m == m and m > 0 for m in med):
            ax.set_xscale("log")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def commit_id() -> str:
    """HEAD's short hash, "+dirty" when tracked files differ from it (a copied tree whose .git is stale
    says so instead of naming a commit it does not run); OMNI_RT_COMMIT overrides."""
    if os.environ.get("OMNI_RT_COMMIT"):
        return os.environ["OMNI_RT_COMMIT"]

    def git(*args: str) -> str:
        out = subprocess.run(
            ["git", *args], capture_output=True, text=True, timeout=5, cwd=Path(__file__).parent
        )
        return out.stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        if not head:
            return "unknown"
        return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except Exception:  # noqa: BLE001 - no git (e.g. an installed wheel)
        return "unknown"


def save_json(
    path: str, meta: dict[str, Any], rows: list[dict[str, Any]], load: list[dict[str, Any]]
) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"meta": meta, "rows": rows, "load": load}, indent=1, default=str))


def exit_if_stalled(
    engine: Any, path: str, meta: dict[str, Any], rows: list[dict[str, Any]], load: list[dict[str, Any]]
) -> None:
    """If `engine` stalled (`Engine.stall`: a stage call never returned), save what was measured, with
    the stall in `meta`, and end the process (status 3) at once: its stage threads are stuck inside the
    device, so a normal exit, or the next row's engine, would wait on them until the call's time limit."""
    stall = getattr(engine, "stall", None)
    if stall is None:
        return
    meta["stall"] = str(stall)
    save_json(path, meta, rows, load)
    print(f"[bench] stopped, the engine stalled: {stall}; partial results in {path}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(3)


def print_checks(rows: list[dict[str, Any]], det: dict[str, Any] | None) -> None:
    agree = [
        f"{r['row']}: {100 * r['greedy_text_agreement_vs_all_off']:.1f} %"
        for r in rows
        if r.get("greedy_text_agreement_vs_all_off") is not None
    ]
    if agree:
        print("greedy text agreement with 'all off' (greedy passes): " + "; ".join(agree))
    forced = [
        f"{r['row']}: {100 * tf['agreement']:.1f} % (mismatches within {tf['max_mismatch_ulps']:.1f} ulp)"
        for r in rows
        if (tf := r.get("greedy_teacher_forced_agreement")) is not None
    ]
    if forced:
        print("greedy next-token agreement with the plain path, per position: " + "; ".join(forced))
    for label, d in (det or {}).items():
        print(
            f"deterministic mode (all on, {label}): {d['identical_runs']}/{d['runs']} runs bit-identical "
            f"(2 alone, {d['alone_then_concurrent'][-1]} at once)"
        )
