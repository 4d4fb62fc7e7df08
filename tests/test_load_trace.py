"""scripts/load_trace.py: which stage made a late reply late, from a traced load level."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import load_trace as lt  # noqa: E402


def test_a_late_delta_is_blamed_on_the_frame_or_on_its_decode():
    # first chunk 1365 samples (57 ms) at 1.0 s; the next 1-frame chunk is due at 1.057 s but comes at
    # 1.2 s: its frame (frame 1) was made at 1.03 s (decode late) or at 1.15 s (frame late)
    reply = {"arrivals": [[1.0, 1365], [1.2, 1920], [1.28, 1920]]}
    assert lt.first_late_delta(reply["arrivals"]) == (1.2, 1365, 1.0 + 1365 / 24000)
    assert lt.why_late(reply, [0.99, 1.03, 1.1]) == "decode late"
    assert lt.why_late(reply, [0.99, 1.15, 1.2]) == "frame late"
    on_time = {"arrivals": [[1.0, 1365], [1.05, 1920], [1.12, 1920]]}
    assert lt.why_late(on_time, [0.99, 1.03, 1.1]) is None
    # within LATE_MS (20 ms) of due is not late
    assert lt.first_late_delta([[1.0, 1365], [1.0569 + 0.019, 1920]]) is None


def test_analyse_counts_stage_calls_and_the_late_replies():
    level = {
        "conversations": 2,
        "late_replies": 1,
        "trace": {
            "responses": [
                {"arrivals": [[1.0, 1365], [1.2, 1920]]},
                {"arrivals": [[1.0, 1365], [1.05, 1920]]},
            ],
            "steps": [
                ["talker", "predict", 0.9, 0.99, [0, 1]],
                ["talker", "predict", 1.0, 1.03, [0, 1]],
                ["code2wav", "chunk", 0.99, 1.0, [0, 1]],
                ["code2wav", "chunk", 1.03, 1.2, [0]],
            ],
        },
    }
    a = lt.analyse(level)
    assert a["why_late"] == {"decode late": 1}
    # reply 0's second chunk (1 frame, frame 1 made at 1.03) was due at 1.057 and came at 1.2, brought by
    # a call of 170 ms with one row
    ((detail),) = a["late_details"]
    assert a["late_at_chunk"] == {1: 1} and detail["frames"] == 1 and detail["call_rows"] == 1
    due = 1.0 + 1365 / 24000
    assert (
        abs(detail["late_ms"] - (1.2 - due) * 1e3) < 1e-6
        and abs(detail["slack_ms"] - (due - 1.03) * 1e3) < 1e-6
    )
    assert abs(detail["call_ms"] - 170.0) < 1e-6
    assert a["stages"]["code2wav.chunk"]["calls"] == 2 and a["stages"]["code2wav.chunk"]["rows"] == 1.5
    assert abs(a["stages"]["talker.predict"]["busy"] - (0.09 + 0.03) / 0.3) < 1e-9


def test_first_audio_path_splits_a_replys_wait_by_what_the_thinker_ran():
    # reply 0 sent at 0.100: the Thinker decodes others until 0.115, prefills reply 1 until 0.130, then
    # reply 0 (0.131-0.152); its Talker start 0.155-0.160 and frame 0 to 0.162; Code2Wav 0.163-0.166;
    # the client has it at 0.167
    level = {
        "trace": {
            "responses": [
                {"t_sent_s": 0.100, "arrivals": [[0.167, 1365]]},
                {"t_sent_s": 0.090, "arrivals": []},  # no audio: left out
            ],
            "steps": [
                ["thinker", "decode", 0.095, 0.115, [2, 3]],
                ["thinker", "prefill", 0.115, 0.130, [1]],
                ["thinker", "prefill", 0.131, 0.152, [0]],
                ["talker", "last", 0.155, 0.160, [0]],
                ["talker", "predict", 0.160, 0.162, [0]],
                ["talker", "predict", 0.170, 0.172, [0]],
                ["code2wav", "chunk", 0.163, 0.166, [0]],
            ],
        }
    }
    path = lt.first_audio_path(level)
    expect = {
        "wait": 31, "behind decode": 15, "behind prefills": 15, "prefill": 21, "to talker": 3,
        "last + frame 0": 7, "to code2wav": 1, "first chunk": 3, "to client": 1,
    }  # fmt: skip
    assert list(path) == list(lt.PATH)
    for k, ms in expect.items():
        assert abs(path[k]["p50"] - ms) < 1e-6 and path[k]["p50"] == path[k]["p90"], k


def test_waits_at_send_say_what_the_thinker_ran_and_the_whole_decode_steps_after():
    # reply 0 is sent during reply 2's prefill, reply 1 during a decode step, replies 2 and 3 between calls;
    # reply 2 then waits behind a whole decode step of 2 rows, replies 0 and 3 behind one of 3 rows
    level = {
        "trace": {
            "responses": [
                {"t_sent_s": 0.105, "arrivals": []},
                {"t_sent_s": 0.095, "arrivals": []},
                {"t_sent_s": 0.080, "arrivals": []},
                {"t_sent_s": 0.121, "arrivals": []},
            ],
            "steps": [
                ["thinker", "decode", 0.090, 0.100, [5, 6]],
                ["thinker", "prefill", 0.100, 0.118, [2, 1]],
                ["thinker", "decode", 0.122, 0.140, [5, 6, 2]],
                ["thinker", "prefill", 0.141, 0.160, [0, 3]],
            ],
        }
    }
    w = lt.waits_at_send(level)
    assert w["at send"] == {"prefill": 1, "decode": 1, "between": 2}
    assert w["behind a whole decode"] == 3  # not reply 1: its step was under way when it was sent
    assert abs(w["its p50 ms"] - 18) < 1e-6 and w["its p50 rows"] == 3
