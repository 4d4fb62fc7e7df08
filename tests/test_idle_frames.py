"""`EngineSettings.programmatic_launch` 'idle': the Talker's runner keeps a second graph of each small
batch's code-predictor frame, captured with the frame's programmatic launches on, and replays it only
while the Thinker has no work on the GPU, which the Thinker's runner says (`StageActivity`) from the
start of a device call to a read-back that waited for it. On the CPU (tiny preset, graphs emulated) with
a frame function that records whether it ran in programmatic mode."""

from __future__ import annotations

import contextlib

import pytest
from test_runners import SETTINGS, emulate_graphs, request, thinker_trace

import omni_rt
from omni_rt.config import EngineSettings
from omni_rt.pipeline.runners import TalkerRunner, ThinkerRunner
from omni_rt.pipeline.stage_device import StageActivity


@pytest.fixture(scope="module")
def model():
    return omni_rt.Engine.load("tiny").model


class ProgrammaticFrame:
    """A code-predictor frame function with `CodeFrame`'s programmatic switch: the plain frame, each call
    recorded with the mode it ran in."""

    programmatic_rows = 1

    def __init__(self) -> None:
        self.on = False
        self.modes: list[bool] = []

    @contextlib.contextmanager
    def programmatic(self):
        self.on = True
        try:
            yield True
        finally:
            self.on = False

    def __call__(self, cp, hidden, code0_embed, sample):
        self.modes.append(self.on)
        cp.frame_fn = None  # the plain frame
        try:
            return cp.predict(hidden, code0_embed, sample)
        finally:
            cp.frame_fn = self


@pytest.fixture
def frame(model, monkeypatch):
    fn = ProgrammaticFrame()
    monkeypatch.setattr(model.talker.code_predictor, "frame_fn", fn)
    return fn


def test_settings_take_the_old_booleans():
    assert EngineSettings().programmatic_launch == "idle"
    assert EngineSettings.all_off().programmatic_launch == "off"
    assert EngineSettings(programmatic_launch=True).programmatic_launch == "always"
    assert EngineSettings(programmatic_launch=False).programmatic_launch == "off"
    assert EngineSettings(programmatic_launch="idle").programmatic_launch == "idle"
    with pytest.raises(ValueError, match="programmatic_launch"):
        EngineSettings(programmatic_launch="sometimes")


def test_idle_frames_replay_only_while_the_thinker_has_no_work(model, frame, monkeypatch):
    captured = emulate_graphs(monkeypatch)
    thinker = StageActivity()
    s = EngineSettings(**SETTINGS, programmatic_launch="idle")
    runner = TalkerRunner(model, s, thinker=thinker)
    # batch 1 only (the frame's programmatic_rows), captured in programmatic mode; batch 2 has none
    assert set(runner._idle_frame_graphs) == {1} and 2 in runner._frame_graphs
    idle, plain = runner._idle_frame_graphs[1], runner._frame_graphs[1]
    assert idle is not plain and idle in captured and frame.modes.count(True) == 1

    def frame_codes(busy: bool):
        thinker.busy = busy
        req = request(model, "Hello there.", 0)
        runner.prefill_prefix([req])
        replays = idle.replays, plain.replays
        code0 = runner.prefill_last([req], [9])[0]  # frame 0 is made here (`frame0_in_prefill`)
        codes = runner.predict([req], [code0])[0]
        return codes, (idle.replays - replays[0], plain.replays - replays[1])

    codes_idle, replays_idle = frame_codes(busy=False)
    codes_busy, replays_busy = frame_codes(busy=True)
    assert replays_idle == (1, 0) and replays_busy == (0, 1)
    assert codes_idle == codes_busy  # the same frame either way


@pytest.mark.parametrize("mode", ["off", "always"])
def test_no_idle_frames_unless_asked(model, frame, monkeypatch, mode):
    emulate_graphs(monkeypatch)
    runner = TalkerRunner(
        model, EngineSettings(**SETTINGS, programmatic_launch=mode), thinker=StageActivity()
    )
    assert runner._idle_frame_graphs == {} and True not in frame.modes


def test_the_thinker_is_busy_from_a_call_to_its_read_back(model, monkeypatch):
    emulate_graphs(monkeypatch)
    activity = StageActivity()
    runner = ThinkerRunner(model, EngineSettings(**SETTINGS), activity=activity)
    seen = []
    decode = runner._decode
    monkeypatch.setattr(runner, "_decode", lambda reqs: seen.append(activity.busy) or decode(reqs))
    text = "Tell me a long story about the sea, the ships and the sailors, please."
    req = request(model, text, 0)
    runner.prefill_piece(req, 8)
    assert activity.busy  # a piece is enqueued with no read-back after it
    thinker_trace(runner, [req], steps=2)  # the prefill's and each decode step's read-backs
    assert seen == [True, True] and not activity.busy
