"""Audio before text (`omni_rt.pipeline.pacing`): the rules on a request's counters, and through the
scheduler with fake stages that make frames slower than twice real time (a small CPU)."""

from __future__ import annotations

import time

import pytest
from test_pipeline_policy import make, request, run, steps

from omni_rt.config import EngineSettings
from omni_rt.pipeline.fake import FakeTimings
from omni_rt.pipeline.pacing import PCM_RATE, audio_ahead_s, chunk_to_decode, may_decode_text
from omni_rt.pipeline.request import AudioOut, Request


def req(tokens: int = 0, frames: int = 0, audio_s: float | None = None, ignore_eos: bool = False) -> Request:
    r, _ = request("r", ignore_eos=ignore_eos)
    r.tokens, r.frames = [7] * tokens, frames
    if audio_s is not None:  # `audio_s` of PCM sent, the first at t = 10
        r.t_first_pcm, r.samples = 10.0, round(audio_s * PCM_RATE)
    return r


def test_audio_ahead_is_what_playback_from_the_first_pcm_has_not_used():
    assert audio_ahead_s(req(), 11.0) is None
    assert audio_ahead_s(req(audio_s=3.0), 11.0) == pytest.approx(2.0)
    assert audio_ahead_s(req(audio_s=0.5), 11.0) == pytest.approx(-0.5)  # it ran dry


def test_the_thinker_keeps_close_to_the_voice_until_the_audio_is_ahead():
    s = EngineSettings(max_text_lead=32, urgent_text_lead=2, audio_ahead_s=1.0)
    assert may_decode_text(req(tokens=3, frames=1), 10.5, s)  # lead 2
    assert not may_decode_text(req(tokens=4, frames=1), 10.5, s)  # lead 3, no audio yet
    assert not may_decode_text(req(tokens=4, frames=1, audio_s=1.2), 10.5, s)  # 0.7 s ahead
    assert may_decode_text(req(tokens=30, frames=1, audio_s=2.0), 10.5, s)  # 1.5 s ahead: up to 32
    assert not may_decode_text(req(tokens=40, frames=1, audio_s=9.0), 10.5, s)
    assert may_decode_text(req(tokens=40, frames=1, ignore_eos=True), 10.5, s)  # fixed lengths
    off = EngineSettings(max_text_lead=32, urgent_text_lead=None)
    assert may_decode_text(req(tokens=30, frames=1), 10.5, off)
    assert may_decode_text(req(tokens=90, frames=1), 10.5, EngineSettings(max_text_lead=None))


def test_chunks_go_early_only_when_the_audio_would_run_dry_first():
    s = EngineSettings(early_chunks=True)  # planned 1, 2, 4, 8, 16, 16, ...
    slow = 0.06  # a frame every 60 ms
    assert chunk_to_decode(4, 2, False, req(audio_s=1.0), slow, 10.5, s) == 4  # planned and whole
    assert chunk_to_decode(3, 2, True, req(audio_s=1.0), slow, 10.5, s) == 3  # the remainder at the end
    # chunk 3 plans 8 frames; 3 pending, 5 more take 300 ms (+ 60 for the decode): 0.5 s ahead is enough
    assert chunk_to_decode(3, 3, False, req(audio_s=1.0), slow, 10.5, s) == 0
    # 0.2 s ahead is not, nor for 4 frames (1 more + 1 interval = 120 ms) with 0.1 s: decode 2 now
    assert chunk_to_decode(3, 3, False, req(audio_s=0.6), slow, 10.5, s) == 2
    assert chunk_to_decode(3, 3, False, req(audio_s=0.7), slow, 10.5, s) == 0  # 0.2 s: wait for 4
    assert chunk_to_decode(1, 3, False, req(audio_s=0.1), slow, 10.5, s) == 1
    assert chunk_to_decode(3, 3, False, req(audio_s=0.7), None, 10.5, s) == 0  # no rate yet: wait
    assert chunk_to_decode(3, 3, False, req(), slow, 10.5, s) == 0  # nothing played yet: the plan
    assert (
        chunk_to_decode(
            3, 3, False, req(audio_s=0.7), slow, 10.5, s.model_copy(update={"early_chunks": False})
        )
        == 0
    )
    fixed = EngineSettings.all_off(
        early_chunks=True
    )  # fixed 4-frame chunks: nothing smaller to go early with
    assert chunk_to_decode(3, 1, False, req(audio_s=0.55), slow, 10.5, fixed) == 0


def played_dry_ms(chunks: list[tuple[float, AudioOut]]) -> float:
    """Total silence of a playback that starts at the first chunk's arrival and plays every chunk in real
    time as soon as it is there: the time the track ran dry."""
    t_play, dry = chunks[0][0], 0.0
    for t, a in chunks:
        if t > t_play:
            dry += t - t_play
            t_play = t
        t_play += len(a.pcm) / PCM_RATE
    return dry * 1000


@pytest.mark.parametrize("early", [True, False])
def test_a_talker_slower_than_twice_real_time_never_runs_dry_with_early_chunks(early):
    """Frames every ~55 ms (faster than real time, slower than the 40 ms that doubling chunks need):
    with early chunks the playback never waits; with the plan alone it runs dry as the chunks double."""
    t = FakeTimings(thinker_decode=0.002, talker_step=0.025, predict=0.03, code2wav_chunk=0.002)
    p = make(EngineSettings(early_chunks=early), t, reply_len=60)
    try:
        r, sink = request("r", max_audio_frames=40)
        run(p, (r, sink))
    finally:
        p.stop()
    chunks = [(ts, m) for ts, m in sink.msgs if isinstance(m, AudioOut)]
    assert sum(a.num_frames for _, a in chunks) == 40
    dry = played_dry_ms(chunks)
    if early:
        assert dry < 20, [a.num_frames for _, a in chunks]
    else:
        assert dry > 100  # the rule is what keeps it fed: this test can fail


def test_the_thinker_stays_within_the_urgent_lead_while_the_audio_catches_up():
    t = FakeTimings(thinker_decode=0.001, talker_step=0.02, predict=0.02)
    p = make(EngineSettings(urgent_text_lead=2, audio_ahead_s=60.0), t, reply_len=200)
    leads: list[int] = []
    decode = p.thinker.decode

    def recording(reqs):
        leads.extend(len(r.tokens) - r.frames for r in reqs)
        return decode(reqs)

    p.thinker.decode = recording
    try:
        r, sink = request("r", max_audio_frames=30, max_output_tokens=200)
        t0 = time.perf_counter()
        run(p, (r, sink))
    finally:
        p.stop()
    assert time.perf_counter() - t0 < 10
    assert leads and max(leads) <= 2  # never further ahead of the voice than the urgent lead
    assert len(steps(p, "thinker", "decode")) <= 30 + 3  # and no text past what was spoken
