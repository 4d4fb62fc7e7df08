"""`EngineSettings.early_start` (tiny, CPU): a response's start (the Talker's last prompt position and
frame 0, Code2Wav's first chunk) enqueued stage after stage on the device, each reading the stage
before's output there, before the host has read it back.

On the CPU a stage call is done when it returns, so these check the bookkeeping that the GPU relies on:
starts go the early way only while the stages hold no other response; tokens, codes and PCM are those of the
start made when the host has the first token; a start made early and never read back (an empty reply,
a codec end at once) leaves nothing behind for the slot's next response.
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch

import omni_rt
from omni_rt.config import EngineSettings
from omni_rt.pipeline.handoff import FirstTokenQueued
from omni_rt.pipeline.request import AudioOut, ErrorOut
from omni_rt.pipeline.runners import build_runners
from omni_rt.pipeline.talker import TalkerLoop
from omni_rt.pipeline.thinker import ThinkerLoop
from tests.test_pipeline_policy import make, run
from tests.test_pipeline_policy import request as policy_request
from tests.test_runners import request

KW = dict(max_output_tokens=6, max_audio_frames=8)


@pytest.fixture(scope="module")
def tiny():
    return omni_rt.Engine.load("tiny")


@pytest.fixture
def read_back_waits(monkeypatch):
    """As on a GPU, where the host waits ~20 ms for the prefill to read back the first token: the Thinker
    thread goes on from telling the Talker that the first token is enqueued only once the Talker's
    iteration that took the message is over (on the CPU the read-back is done at once, and the Talker
    would mostly find the first token there already, and the start then made the usual way)."""
    handled: dict = {}
    iteration, first_queued = TalkerLoop._iteration, ThinkerLoop._first_queued

    def talker_iteration(self, msgs, seqs):
        try:
            iteration(self, msgs, seqs)
        finally:
            for m in msgs:
                if isinstance(m, FirstTokenQueued):
                    handled.setdefault(m.req, threading.Event()).set()

    def thinker_first_queued(self, reqs, ready):
        first_queued(self, reqs, ready)
        for r in reqs:
            assert handled.setdefault(r, threading.Event()).wait(30)

    monkeypatch.setattr(TalkerLoop, "_iteration", talker_iteration)
    monkeypatch.setattr(ThinkerLoop, "_first_queued", thinker_first_queued)


def engine_of(tiny, early: bool, sessions: int = 2) -> omni_rt.Engine:
    settings = omni_rt.EngineSettings(max_sessions=sessions, early_start=early)
    return omni_rt.Engine(
        tiny.cfg, tiny.tokenizer, lambda st: build_runners(tiny.model, st), settings, model=tiny.model
    )


def text_and_pcm(events) -> tuple[list[int], np.ndarray]:
    assert events[-1].type == "response.done" and events[-1].status == "completed", events[-1]
    tokens = [t for e in events if e.type == "response.output_text.delta" for t in e.token_ids]
    pcm = [e.pcm for e in events if e.type == "response.output_audio.delta"]
    return tokens, np.concatenate(pcm) if pcm else np.zeros(0, np.int16)


def queued(engine: omni_rt.Engine, stage: str) -> set[str]:
    """The requests whose start `stage` enqueued early."""
    return {
        r for st in engine.pipeline.steps if st.stage == stage and st.kind == "queue" for r in st.request_ids
    }


async def test_a_start_made_early_gives_what_the_start_made_late_does(tiny, read_back_waits):
    turns = ["Hello there.", "Tell me a story.", "And one more thing?"]
    runs, early_ids = {}, {}
    for early in (True, False):
        engine = engine_of(tiny, early)
        async with engine, engine.session() as s:
            replies = []
            for k, text in enumerate(turns):  # one conversation: later turns start in a used slot
                events = [
                    ev async for ev in s.respond(text=text, sampling=omni_rt.Sampling(seed=7 + k), **KW)
                ]
                replies.append(text_and_pcm(events))
            early_ids[early] = (queued(engine, "talker"), queued(engine, "code2wav"))
        runs[early] = replies
    assert len(early_ids[True][0]) == len(turns) and early_ids[True][0] == early_ids[True][1]
    assert early_ids[False] == (set(), set())
    for (t_early, pcm_early), (t_late, pcm_late) in zip(runs[True], runs[False], strict=True):
        assert t_early == t_late and len(pcm_early) > 0
        np.testing.assert_array_equal(pcm_early, pcm_late)


async def test_no_early_start_while_another_response_is_speaking(tiny, read_back_waits):
    engine = engine_of(tiny, True)
    async with engine, engine.session() as a, engine.session() as b:
        first_audio = asyncio.Event()

        async def speak_long() -> list:
            events = []
            async for ev in a.respond(
                text="Talk for a while.", sampling=omni_rt.Sampling(seed=1), max_output_tokens=40,
                max_audio_frames=60, ignore_eos=True,
            ):  # fmt: skip
                events.append(ev)
                if ev.type == "response.output_audio.delta":
                    first_audio.set()
            return events

        long = asyncio.create_task(speak_long())
        await first_audio.wait()  # a is speaking: b's start waits for its first token on the host
        events = [ev async for ev in b.respond(text="Quick one.", sampling=omni_rt.Sampling(seed=2), **KW)]
        text_and_pcm(events)
        text_and_pcm(await long)
        rid_b = events[-1].response_id
        early = queued(engine, "talker")
    assert rid_b not in early and len(early) == 1  # only a's start, when it was alone


def test_a_start_made_early_and_never_read_back_leaves_nothing_behind(tiny):
    """Say the reply was empty: the Talker's and Code2Wav's early work for it is never read back. The
    slot's next response, started the usual way, gets what it gets on fresh runners."""
    settings = omni_rt.EngineSettings(max_sessions=1, early_start=True)
    used = build_runners(tiny.model, settings)
    thinker, talker, code2wav = used
    gone = request(tiny.model, "Hello there.", 0)
    talker.prefill_prefix([gone])
    readies = []
    thinker.prefill([gone], queued=lambda reqs, ready: readies.append(ready))
    assert readies == [None]  # off the GPU: nothing to wait for
    code2wav.queue_first(gone, talker.queue_last([gone], readies[0]))
    code2wav.close(gone)  # its audio ended with no frame: the scheduler closes its stream

    outs = []
    for runners in (used, build_runners(tiny.model, settings)):
        _, talker, code2wav = runners
        nxt = request(tiny.model, "Something else entirely.", 0)
        talker.prefill_prefix([nxt])
        code0 = talker.prefill_last([nxt], [9])
        frame = talker.predict([nxt], code0)[0]
        code2wav.open(nxt)
        outs.append((code0, frame, code2wav.push(nxt, [frame])))
    assert outs[0][:2] == outs[1][:2]
    np.testing.assert_array_equal(outs[0][2], outs[1][2])


def test_an_early_frame_0_in_a_chunk_of_several_frames_is_read_back_before_the_others(tiny):
    """Code2Wav's first chunk may hold more frames than the one decoded early (they came together): the
    chunk's PCM is frame 0's, read back, then the rest's, decoded after it: what a stream decodes when
    pushed frame 0, then the rest."""
    settings = omni_rt.EngineSettings(max_sessions=1, early_start=True)
    outs = []
    for early in (True, False):
        thinker, talker, code2wav = build_runners(tiny.model, settings)
        req = request(tiny.model, "Hello there.", 0)
        talker.prefill_prefix([req])
        readies: list = []
        first = thinker.prefill([req], queued=lambda reqs, ready, r=readies: r.append(ready))
        if early:
            code2wav.queue_first(req, talker.queue_last([req], readies[0]))
        code0 = talker.prefill_last([req], first)
        hidden = talker._last_hidden[0].clone()  # the last position's: its input is the first token
        frames = [talker.predict([req], code0)[0]]
        code0 = talker.step([req], frames[-1:], [5])
        frames.append(talker.predict([req], code0)[0])
        if early:
            pcm = code2wav.push(req, frames)
        else:  # the same cuts: frame 0, then the rest (other cuts differ by float rounding)
            code2wav.open(req)
            pcm = np.concatenate([code2wav.push(req, frames[:1]), code2wav.push(req, frames[1:])])
        outs.append((frames, pcm, hidden))
        assert not code2wav._queued and not talker._queued  # read back, nothing kept
    assert outs[0][0] == outs[1][0] and torch.equal(outs[0][2], outs[1][2])
    np.testing.assert_array_equal(outs[0][1], outs[1][1])


def test_a_start_that_fails_on_the_way_fails_alone(read_back_waits):
    """Two responses start together (one Thinker prefill): the Talker's early start of one fails, and so
    does that response alone; Code2Wav's early decode of a later one fails, and so does it alone. Each
    other response speaks to its end."""
    p = make(EngineSettings(early_start=True), talker={"queue:bad"}, code2wav={"queue:worse"}, reply_len=4)
    try:
        good, good_sink = policy_request("good", slot=0, max_audio_frames=6)
        bad, bad_sink = policy_request("bad", slot=1, max_audio_frames=6)
        run(p, (good, good_sink), (bad, bad_sink))
        assert {s.request_ids for s in p.steps if s.stage == "talker" and s.kind == "queue"} >= {("good",)}
        worse, worse_sink = policy_request("worse", slot=1, max_audio_frames=6)
        run(p, (worse, worse_sink))
        after, after_sink = policy_request("after", slot=1, max_audio_frames=6)
        run(p, (after, after_sink))
    finally:
        p.stop()
    for sink in (bad_sink, worse_sink):
        (error,) = sink.of(ErrorOut)
        assert "scripted failure in queue" in str(error.error) and not sink.of(AudioOut)
    for sink in (good_sink, after_sink):
        assert not sink.of(ErrorOut) and len(sink.of(AudioOut)) > 0
