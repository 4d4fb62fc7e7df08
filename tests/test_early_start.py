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
from omni_rt.pipeline.talker import TalkerLoop, TalkerPhase, TalkerSeq
from omni_rt.pipeline.thinker import ThinkerLoop
from tests.test_pipeline_policy import make, run, steps
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
    """A response starts alone and the Talker's early start of it fails: that response fails; a later
    one's early Code2Wav decode fails: that one fails. The responses before and after speak to their end,
    the first and the last of them started early."""
    p = make(EngineSettings(early_start=True), talker={"queue:bad"}, code2wav={"queue:worse"}, reply_len=4)
    sinks = {}
    try:
        for rid in ("good", "bad", "worse", "after"):
            req, sinks[rid] = policy_request(rid, slot=0, max_audio_frames=6)
            run(p, (req, sinks[rid]))
        queued_by = {st: {s.request_ids for s in steps(p, st, "queue")} for st in ("talker", "code2wav")}
    finally:
        p.stop()
    assert queued_by["talker"] == {("good",), ("worse",), ("after",)}  # bad's try raised: no step recorded
    assert queued_by["code2wav"] == {("good",), ("after",)}
    for rid in ("bad", "worse"):
        (error,) = sinks[rid].of(ErrorOut)
        assert "scripted failure in queue" in str(error.error) and not sinks[rid].of(AudioOut)
    for rid in ("good", "after"):
        assert not sinks[rid].of(ErrorOut) and len(sinks[rid].of(AudioOut)) > 0


def test_starts_from_one_prefill_go_the_usual_way():
    """Two responses whose first tokens one prefill enqueued: neither start is enqueued early (on an H200
    8 such starts took 57.5 ms to first audio early, 41.2 the usual way), and neither is tried again."""

    class NoStage:
        def __getattr__(self, name):
            raise AssertionError(f"an early start was tried: {name}")

    loop = TalkerLoop(NoStage())
    ready = object()
    seqs = {}
    for rid in ("a", "b"):
        req, _ = policy_request(rid, slot=len(seqs))
        seqs[req] = TalkerSeq(req, phase=TalkerPhase.READY, first_queued=True, first_ready=ready)
    loop._queue_starts(seqs)
    assert not any(s.first_queued for s in seqs.values())


def test_early_start_is_on_by_default_where_the_model_runs_on_a_gpu():
    """Off the GPU a stage call is done when it returns, so an early start gains nothing there: the
    default resolves by the model's device (`for_device`); asked for, it runs anywhere (these tests)."""
    assert EngineSettings().for_device("cuda").starts_early
    assert not EngineSettings().for_device("cpu").starts_early
    assert not EngineSettings().starts_early  # an engine of fake stages, no model: nothing resolved it
    assert EngineSettings(early_start=True).for_device("cpu").starts_early
    assert not EngineSettings(early_start=False).for_device("cuda").starts_early
    # it needs the Talker's prompt prefix in its cache before the first token
    assert not EngineSettings(talker_overlap_prefill=False).for_device("cuda").starts_early
    assert not EngineSettings.all_off().for_device("cuda").starts_early
