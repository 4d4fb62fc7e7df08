"""The spoken-question rows of `omni-rt bench --speech-turn` (omni_rt.bench_speech), on tiny (CPU): a
question fed in real time through the server's socket path, its turn ended by server VAD, the reply's
figures measured from the end of the turn."""

from __future__ import annotations

import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("websockets")

import omni_rt  # noqa: E402
from omni_rt import bench  # noqa: E402
from omni_rt.bench_speech import (  # noqa: E402
    RATE,
    format_speech_table,
    question_audio,
    run_speech_rows,
    smart_turn_heard,
    speech_row_plan,
)


def test_the_speech_flag_alone_runs_no_protocol_rows():
    args = bench.parse_args(["--speech-turn"])
    assert args.speech_turn and args.speech_seconds == 5.0
    assert bench._select_rows(args, bench.row_plan("cpu", kernel_ok=False)) == []


def test_the_question_is_about_as_long_as_asked():
    audio, source = question_audio(5.0, seed=0)
    assert audio.dtype.name == "float32" and 3.5 < len(audio) / RATE < 6.5, source


def test_a_semantic_vad_row_says_whether_smart_turn_hears_the_question_finished():
    # issue 12: the row's figures are the longest wait when the model hears the question unfinished
    audio, _ = question_audio(5.0, seed=0)
    heard = smart_turn_heard(audio, speech_row_plan())
    (row,) = [name for name, _, d in speech_row_plan() if d["type"] == "semantic_vad"]
    assert list(heard) == [row]
    assert 0.0 <= heard[row]["smart_turn_probability"] <= 1.0
    assert (heard[row]["completion_threshold"], heard[row]["max_wait_ms"]) == (0.5, 4000)  # auto
    assert smart_turn_heard(audio, speech_row_plan()[:1]) == {}  # server_vad: no model asked


def test_speech_rows_smoke_tiny_cpu():
    args = bench.parse_args(
        ["--preset", "tiny", "--device", "cpu", "--speech-turn", "--speech-seconds", "1.5",
         "--speech-requests", "1", "--speech-warmup", "0", "--text-tokens", "3", "--frames", "3"]
    )  # fmt: skip
    made = []

    def make_engine(overrides):
        made.append(overrides)
        return omni_rt.Engine.load("tiny", **overrides)

    plan = speech_row_plan()[:1]  # server_vad, everything on
    rows = run_speech_rows(args, make_engine, plan)
    assert made == [{}]  # the text and spoken rows share the all-on engine
    text, spoken = rows
    assert text["row"] == "text turn (all on)" and text["median_ttfa_ms"] > 0
    (s,) = spoken["samples"]
    assert s["turns"] == 1 and s["status"] in ("completed", "incomplete")
    # the reply was started at the pause and released at the end of the turn
    assert s["held_ms"] is not None and s["end_of_turn_to_first_audio_ms"] > 0
    assert s["voice_to_voice_ms"] > 0 and s["end_of_speech_ms"] > 500  # after the 0.5 s lead-in
    assert spoken["end_of_turn_vs_text_ttfa_ms"] == pytest.approx(
        spoken["median_end_of_turn_to_first_audio_ms"] - text["median_ttfa_ms"]
    )
    table = format_speech_table(rows)
    assert "spoken, server_vad (all on)" in table and "end of turn->audio" in table
