"""The scheduler's policy with fake stages (scripted durations): who waits for whom, and for how long."""

from __future__ import annotations

import inspect
import threading
import time
import types

import numpy as np
import pytest

from omni_rt.config import EngineSettings, Sampling
from omni_rt.errors import EngineClosedError, StageError
from omni_rt.model.config import TokenIds
from omni_rt.pipeline import inbox as inbox_mod
from omni_rt.pipeline import scheduler as scheduler_mod
from omni_rt.pipeline.fake import FakeCode2Wav, FakeTalker, FakeThinker, FakeTimings
from omni_rt.pipeline.handoff import Progress, Spoken
from omni_rt.pipeline.request import (
    AudioDoneOut,
    AudioOut,
    DoneOut,
    ErrorOut,
    Request,
    TextOut,
    TranscriptOut,
)
from omni_rt.pipeline.scheduler import Pipeline
from omni_rt.pipeline.talker import TalkerLoop, TalkerSeq

IDS = TokenIds()
PROMPT = [
    IDS.im_start,
    IDS.user,
    IDS.newline,
    11,
    12,
    13,
    IDS.im_end,
    IDS.newline,
    IDS.im_start,
    IDS.assistant,
    198,
]


class Collector:
    """A request's sink: every message with its arrival time; `done` is set by DoneOut."""

    def __init__(self) -> None:
        self.msgs: list[tuple[float, object]] = []
        self.done = threading.Event()

    def __call__(self, msg: object) -> None:
        self.msgs.append((time.perf_counter(), msg))
        if isinstance(msg, DoneOut):
            self.done.set()

    def of(self, kind: type) -> list:
        return [m for _, m in self.msgs if isinstance(m, kind)]


def make(
    settings: EngineSettings | None = None,
    timings: FakeTimings | None = None,
    reply_len: int = 8,
    talker_stage: FakeTalker | None = None,
    **fail,
):
    t = timings or FakeTimings()
    p = Pipeline(
        FakeThinker(t, IDS, reply_len=reply_len, fail_on=fail.get("thinker")),
        talker_stage or FakeTalker(t, IDS, fail_on=fail.get("talker")),
        FakeCode2Wav(t, fail_on=fail.get("code2wav")),
        settings or EngineSettings(),
        IDS,
    )
    p.start()
    return p


def request(rid: str, slot: int = 0, prompt: list[int] = PROMPT, **kw) -> tuple[Request, Collector]:
    sink = Collector()
    req = Request(
        id=rid,
        slot=slot,
        prompt_ids=list(prompt),
        thinker_start=0,
        talker_start=0,
        speaker_id=2302,
        sampling=Sampling.greedy(),
        max_output_tokens=kw.pop("max_output_tokens", 256),
        max_audio_frames=kw.pop("max_audio_frames", 256),
        sink=sink,
        t0=time.perf_counter(),
        **kw,
    )
    return req, sink


def submit_at(req: Request, sink: Collector, kind: type, n: int, action) -> None:
    """Run `action` from the stage thread that posts `req`'s `n`-th message of `kind` (an event, not a
    sleep, starts the next request)."""
    seen = []

    def hook(msg):
        sink(msg)
        if isinstance(msg, kind):
            seen.append(msg)
            if len(seen) == n:
                action()

    req.sink = hook


def run(p: Pipeline, *reqs: tuple[Request, Collector], timeout: float = 20.0) -> None:
    for req, _ in reqs:
        p.submit(req)
    for _, sink in reqs:
        assert sink.done.wait(timeout), "response never finished"


def steps(p: Pipeline, stage: str, kind: str) -> list:
    return [s for s in p.steps if s.stage == stage and s.kind == kind]


def test_first_audio_before_last_text_delta():
    p = make(reply_len=30)
    try:
        req, sink = request("r")
        run(p, (req, sink))
    finally:
        p.stop()
    order = [m for _, m in sink.msgs]
    first_audio = next(i for i, m in enumerate(order) if isinstance(m, AudioOut))
    last_text = max(i for i, m in enumerate(order) if isinstance(m, TextOut))
    assert first_audio < last_text
    assert isinstance(order[-1], DoneOut) and order[-1].status == "completed"
    assert isinstance(order[-2], AudioDoneOut)
    # frames: one per text token (im_end not spoken), then tts_eos, then pads until the fake's EOS
    assert req.frames == 29 + 1 + 2 - 1
    assert sum(a.num_frames for a in sink.of(AudioOut)) == req.frames
    assert req.samples == 1920 * req.frames - 555


def test_thinker_second_step_starts_at_frame0_when_talker_is_fast():
    # frame 0 takes ~4 ms; a roomy cap keeps the test deterministic on a loaded machine
    p = make(
        EngineSettings(yield_to_talker_ms=100, yield_until="frame0"),
        FakeTimings(thinker_prefill=0.02, talker_last=0.002, predict=0.002, code2wav_chunk=0.03),
    )
    try:
        req, sink = request("r")
        run(p, (req, sink))
    finally:
        p.stop()
    assert len(p.yields) == 1 and p.yields[0].woke_by == "frame0"
    assert req.yield_outcome == "frame0"  # the response's own outcome (its metrics' thinker_yield)
    frame0 = steps(p, "talker", "predict")[0]
    decode1 = steps(p, "thinker", "decode")[0]
    # the Thinker's second step waited for frame 0, and no longer than the cap
    assert decode1.t_start >= frame0.t_end
    assert decode1.t_start < steps(p, "code2wav", "chunk")[0].t_end  # not for the first audio
    assert p.yields[0].t_end - p.yields[0].t_start < 0.1


def test_thinker_second_step_waits_for_the_first_audio_when_asked():
    p = make(
        EngineSettings(yield_to_talker_ms=100, yield_until="first_audio"),
        FakeTimings(thinker_prefill=0.02, talker_last=0.002, predict=0.002, code2wav_chunk=0.03),
    )
    r = request("r")
    try:
        run(p, r)
    finally:
        p.stop()
    assert len(p.yields) == 1 and p.yields[0].woke_by == "frame0" and r[0].yield_outcome == "first_audio"
    first_chunk = steps(p, "code2wav", "chunk")[0]
    decode1 = steps(p, "thinker", "decode")[0]
    assert decode1.t_start >= first_chunk.t_end  # the first PCM chunk ran without the Thinker beside it
    assert p.yields[0].t_end - p.yields[0].t_start < 0.1


def test_thinker_second_step_starts_at_cap_when_talker_is_slow():
    p = make(EngineSettings(yield_to_talker_ms=12), FakeTimings(talker_last=0.150))
    try:
        req, sink = request("r")
        run(p, (req, sink))
    finally:
        p.stop()
    assert len(p.yields) == 1 and p.yields[0].woke_by == "cap" and req.yield_outcome == "cap"
    waited = p.yields[0].t_end - p.yields[0].t_start
    assert waited >= 0.012
    frame0 = steps(p, "talker", "predict")[0]
    decode1 = steps(p, "thinker", "decode")[0]
    assert decode1.t_start < frame0.t_start  # gave up before frame 0 was even being predicted
    assert decode1.t_start - steps(p, "thinker", "prefill")[0].t_end < 0.012 + 0.1


def test_a_response_whose_first_audio_is_out_before_the_next_step_needs_no_yield():
    # the Thinker's next step after a first token: a response whose first audio is already out (frame0
    # no longer pending) waits for nothing and says "not_needed"; one still pending waits (to the cap
    # here: nothing makes its audio) and says "cap"; a response still before its first token says nothing
    p = make(EngineSettings(yield_to_talker_ms=5, yield_until="first_audio"))
    try:
        out, pending, before = request("out")[0], request("pending", slot=1)[0], request("before", slot=2)[0]
        out.tokens, pending.tokens = [7], [7]
        pending.frame0_pending = True
        p._text._yield_to_talker([out, pending, before])
    finally:
        p.stop()
    assert (out.yield_outcome, pending.yield_outcome, before.yield_outcome) == ("not_needed", "cap", None)
    assert [y.woke_by for y in p.yields] == ["cap"]  # one wait, for the pending one


def test_no_yield_when_switched_off():
    p = make(EngineSettings(yield_to_talker_ms=0), FakeTimings(talker_last=0.100))
    r = request("r")
    try:
        run(p, r)
    finally:
        p.stop()
    assert p.yields == [] and r[0].yield_outcome is None
    assert steps(p, "thinker", "decode")[0].t_start < steps(p, "talker", "predict")[0].t_start


def test_handoffs_are_event_driven_not_polled(monkeypatch):
    timeouts: list[float | None] = []

    class RecordingCondition(threading.Condition):
        def wait(self, timeout=None):
            timeouts.append(timeout)
            return super().wait(timeout)

    # only the inbox module sees the recording Condition (threading itself stays untouched)
    monkeypatch.setattr(inbox_mod, "threading", types.SimpleNamespace(Condition=RecordingCondition))
    p = make(reply_len=12)
    try:
        run(p, request("a"), request("b", slot=1, prompt=PROMPT[:3] + [77] + PROMPT[3:]))
    finally:
        p.stop()
    # every inbox sleep has no timeout: only a message (or stop) wakes a stage (with early_chunks, a GPU's
    # default, Code2Wav also wakes when an early chunk comes due by the clock: test_pacing)
    assert timeouts and all(t is None for t in timeouts)
    for box in (p.thinker_inbox, p.talker_inbox, p.code2wav_inbox):
        assert box.empty_wakeups == 0
        assert box.waits <= box.puts + 1  # each sleep ended by a put (the +1: close at stop)
    # the scheduler's own code and its stage loops never sleep; their one timed wait is the bounded
    # Thinker yield
    from omni_rt.pipeline import code2wav, talker, thinker

    src = "".join(inspect.getsource(m) for m in (scheduler_mod, thinker, talker, code2wav))
    assert "sleep(" not in src
    assert src.count(".wait(") == 1 and "self.p._frame0.wait(left)" in src


def test_all_off_behaves_like_a_stock_stack():
    t = FakeTimings(thinker_prefill=0.02, thinker_decode=0.01)
    p = make(EngineSettings.all_off(), t, reply_len=12)
    try:
        req, sink = request("r")
        run(p, (req, sink))
    finally:
        p.stop()
    prefill = steps(p, "thinker", "prefill")[0]
    decodes = steps(p, "thinker", "decode")
    talker_prefix = steps(p, "talker", "prefix")[0]
    frame0 = steps(p, "talker", "predict")[0]
    # no overlap: the Talker's prefix waits for the Thinker's output, which waits one more step
    assert talker_prefix.t_start >= decodes[0].t_end
    # frame 0's residual codes come with the next Talker step, which needs text token 1 (handed over
    # after decode 2): an extra step on each side
    assert frame0.t_start >= decodes[1].t_end
    assert [a.num_frames for a in sink.of(AudioOut)][:2] == [4, 4]
    assert p.yields == []
    assert prefill.t_end <= talker_prefix.t_start


def test_overlap_prefill_and_growing_chunks():
    p = make(EngineSettings(), FakeTimings(thinker_prefill=0.05, talker_prefix=0.005), reply_len=40)
    try:
        req, sink = request("r")
        run(p, (req, sink))
    finally:
        p.stop()
    prefill = steps(p, "thinker", "prefill")[0]
    prefix = steps(p, "talker", "prefix")[0]
    assert prefix.t_start < prefill.t_end  # Talker prefix prefilled during the Thinker prefill
    sizes = [a.num_frames for a in sink.of(AudioOut)]
    assert sizes[0] == 1
    grown = sizes[:-1]  # the last chunk is the remainder at the end
    assert grown == sorted(grown) and max(sizes) <= 16
    assert all(s in (1, 2, 4, 8, 16) for s in grown)
    assert [a.frame_index for a in sink.of(AudioOut)] == [sum(sizes[:i]) for i in range(len(sizes))]


def test_cancel_mid_response_stops_audio_and_keeps_pipeline_usable():
    p = make(reply_len=200, timings=FakeTimings(thinker_decode=0.005))
    try:
        req, sink = request("r")
        p.submit(req)
        # cancel once audio is flowing
        deadline = time.time() + 10
        while not sink.of(AudioOut) and time.time() < deadline:
            time.sleep(0.005)
        p.cancel(req)
        assert sink.done.wait(10)
        order = [m for _, m in sink.msgs]
        assert isinstance(order[-1], DoneOut) and order[-1].status == "cancelled"
        assert req.holders == set()
        frames_at_cancel = req.frames
        assert len(req.tokens) < 199
        # a next request on the same slot runs to completion
        req2, sink2 = request("r2")
        run(p, (req2, sink2))
        assert sink2.of(DoneOut)[0].status == "completed"
        assert req.frames == frames_at_cancel  # nothing more was made for the cancelled one
    finally:
        p.stop()


def test_two_requests_at_once_get_what_they_get_alone():
    prompts = [PROMPT, PROMPT[:3] + [99, 98] + PROMPT[3:]]

    def outputs(sink: Collector) -> tuple:
        return (
            [m.token_id for m in sink.of(TextOut)],
            [m.token_id for m in sink.of(TranscriptOut)],
            np.concatenate([a.pcm for a in sink.of(AudioOut)])[::97].tolist(),  # chunking may differ
        )

    alone = []
    for i, prompt in enumerate(prompts):
        p = make(reply_len=10)
        try:
            r = request(f"alone{i}", prompt=prompt)
            run(p, r)
            alone.append(outputs(r[1]))
        finally:
            p.stop()
    p = make(reply_len=10)
    try:
        both = [request(f"both{i}", slot=i, prompt=pr) for i, pr in enumerate(prompts)]
        run(p, *both)
    finally:
        p.stop()
    assert [outputs(s) for _, s in both] == alone
    assert any(len(s.request_ids) == 2 for s in steps(p, "thinker", "decode"))  # they were batched


@pytest.mark.parametrize("deterministic", [False, True])
def test_code2wav_batches_same_size_chunks_of_conversations_and_each_gets_its_own_audio(deterministic):
    # Code2Wav (20 ms a call) is slower than the frames (one per 2 ms), so both conversations have a
    # chunk of the planned size waiting whenever a chunk is chosen: with code2wav_batch they go in one
    # call; each conversation's PCM is what it gets alone. Deterministic mode decodes one at a time.
    s = EngineSettings(code2wav_batch=True, deterministic=deterministic, yield_to_talker_ms=0)
    t = FakeTimings(thinker_decode=0.001, talker_step=0.001, predict=0.001, code2wav_chunk=0.02)
    prompts = [PROMPT, PROMPT[:3] + [99, 98] + PROMPT[3:]]
    pcm = lambda sink: np.concatenate([a.pcm for a in sink.of(AudioOut)]).tolist()  # noqa: E731
    alone = []
    for i, prompt in enumerate(prompts):
        p = make(s, t, reply_len=30)
        try:
            r = request(f"alone{i}", prompt=prompt, max_audio_frames=24)
            run(p, r)
            alone.append(pcm(r[1]))
        finally:
            p.stop()
    p = make(s, t, reply_len=30)
    try:
        both = [request(f"both{i}", slot=i, prompt=pr, max_audio_frames=24) for i, pr in enumerate(prompts)]
        run(p, *both)
    finally:
        p.stop()
    assert [pcm(sink) for _, sink in both] == alone
    batched = [c for c in steps(p, "code2wav", "chunk") if len(c.request_ids) == 2]
    assert (not batched) if deterministic else batched, steps(p, "code2wav", "chunk")


def test_a_batched_code2wav_call_that_fails_is_retried_alone_and_fails_only_its_request():
    # B's chunks fail wherever they are decoded; A's chunks share B's calls (same sizes, both waiting on
    # a slow Code2Wav): the failed batched call is tried again a response at a time, so A plays all of
    # its audio and only B fails
    s = EngineSettings(code2wav_batch=True, yield_to_talker_ms=0)
    t = FakeTimings(thinker_decode=0.001, talker_step=0.001, predict=0.001, code2wav_chunk=0.02)
    p = make(s, t, reply_len=30, code2wav={"chunk:b"})
    a, b = request("a", max_audio_frames=24), request("b", slot=1, max_audio_frames=24)
    try:
        run(p, a, b)
    finally:
        p.stop()
    assert sum(m.num_frames for m in a[1].of(AudioOut)) == 24 and not a[1].of(ErrorOut)
    assert b[1].of(ErrorOut) and not b[1].of(AudioOut)
    assert any(set(c.request_ids) == {"a"} for c in steps(p, "code2wav", "chunk"))


def test_stage_failure_fails_only_that_request():
    p = make(talker={"prefix:bad"})
    try:
        bad, good = request("bad"), request("good", slot=1)
        run(p, bad, good)
    finally:
        p.stop()
    errs = bad[1].of(ErrorOut)
    assert len(errs) == 1 and isinstance(errs[0].error, StageError)
    assert bad[1].of(DoneOut)[0].status == "failed"
    assert not bad[1].of(AudioOut)
    assert good[1].of(DoneOut)[0].status == "completed" and good[1].of(AudioOut)


def test_decode_crash_fails_batch_with_error_and_done():
    p = make(thinker={"decode"})
    try:
        r = request("r")
        run(p, r)
        assert r[1].of(DoneOut)[0].status == "failed"
        assert "decode" in str(r[1].of(ErrorOut)[0].error)
    finally:
        p.stop()


def test_stop_fails_in_flight_and_leaves_no_threads():
    p = make(reply_len=10_000, timings=FakeTimings(thinker_decode=0.002))
    req, sink = request("r", max_output_tokens=100_000)
    p.submit(req)
    time.sleep(0.05)
    p.stop()
    assert sink.done.wait(5)
    assert isinstance(sink.of(ErrorOut)[0].error, EngineClosedError)
    assert sink.of(DoneOut)[0].status == "failed"
    assert not [t for t in threading.enumerate() if t.name.startswith("omni-rt-")]
    with pytest.raises(EngineClosedError):
        p.submit(request("late")[0])


def test_max_limits_end_the_response():
    p = make(reply_len=1000)
    try:
        req, sink = request("r", max_output_tokens=5, max_audio_frames=1000)
        run(p, (req, sink))
        capped, capped_sink = request("c", max_output_tokens=1000, max_audio_frames=3)
        run(p, (capped, capped_sink))
    finally:
        p.stop()
    assert len(req.tokens) == 5
    assert sink.of(DoneOut)[0].status == "completed"
    # the audio cap ends the text too: what is not spoken is not the reply
    assert capped.frames == 3 and len(capped.tokens) < 1000
    assert capped_sink.of(DoneOut)[0].status == "completed"


def test_stop_ends_requests_that_no_stage_has_seen_yet():
    # the Thinker is busy with a long prefill; the second request is still in its inbox at stop
    p = make(timings=FakeTimings(thinker_prefill=0.3))
    busy, queued = request("busy"), request("queued", slot=1)
    p.submit(busy[0])
    p.submit(queued[0])
    time.sleep(0.05)
    p.stop()
    for _, sink in (busy, queued):
        assert sink.done.wait(5)
        assert sink.of(DoneOut)[0].status == "failed"
        assert isinstance(sink.of(ErrorOut)[0].error, EngineClosedError)


@pytest.mark.parametrize(
    "switch",
    [
        dict(talker_overlap_prefill=False),
        dict(frame0_in_prefill=False),
        dict(handoff="after_step"),
        dict(first_chunk_frames=4, chunk_growth=False, max_chunk_frames=4),
        dict(yield_to_talker_ms=0),
        dict(deterministic=True),
    ],
    ids=lambda d: ",".join(d),
)
def test_each_switch_alone_changes_timing_not_output(switch):
    def outputs(settings):
        p = make(settings, reply_len=9)
        try:
            req, sink = request("r")
            run(p, (req, sink))
        finally:
            p.stop()
        assert sink.of(DoneOut)[0].status == "completed"
        return (
            [m.token_id for m in sink.of(TextOut)],
            [m.token_id for m in sink.of(TranscriptOut)],
            np.concatenate([a.pcm for a in sink.of(AudioOut)]).tolist(),
        )

    assert outputs(EngineSettings(**switch)) == outputs(EngineSettings())


def two_behind_a_first(p: Pipeline) -> tuple[tuple[Request, Collector], tuple[Request, Collector]]:
    """Submit "first", then "a" and "b" while the Thinker prefills it (so they queue up together); run
    all three to the end and stop `p`: (a, b)."""
    try:
        first = request("first")
        p.submit(first[0])
        time.sleep(0.03)  # the Thinker is busy prefilling "first": the next two queue up together
        pair = request("a", slot=1), request("b", slot=2, prompt=PROMPT[:3] + [5] + PROMPT[3:])
        run(p, *pair)
        assert first[1].done.wait(10)
    finally:
        p.stop()
    return pair


def test_requests_that_arrive_together_prefill_together():
    p = make(timings=FakeTimings(thinker_prefill=0.1), reply_len=4)
    pair = two_behind_a_first(p)
    assert [s.request_ids for s in steps(p, "thinker", "prefill")] == [("first",), ("a", "b")]
    assert all(s.of(DoneOut)[0].status == "completed" for _, s in pair)


def test_responses_that_start_together_share_the_talkers_prefix_and_first_position_calls():
    # the Talker is busy with "first"'s prefix (0.3 s) while "a" and "b" are admitted together (at 0.1 s):
    # their prefixes go in one call, then (their first tokens from one prefill) their first positions too
    p = make(timings=FakeTimings(thinker_prefill=0.1, talker_prefix=0.3), reply_len=4)
    pair = two_behind_a_first(p)
    assert [s.request_ids for s in steps(p, "talker", "prefix")] == [("first",), ("a", "b")]
    assert any({"a", "b"} <= set(s.request_ids) for s in steps(p, "talker", "last"))  # "first" too, here
    assert all(s.of(DoneOut)[0].status == "completed" for _, s in pair)


def test_a_prefix_that_fails_in_a_shared_call_fails_only_its_request():
    # as above, "b"'s prefix raises: the shared call is tried again a response at a time
    p = make(timings=FakeTimings(thinker_prefill=0.1, talker_prefix=0.3), reply_len=4, talker={"prefix:b"})
    a, b = two_behind_a_first(p)
    calls = [s.request_ids for s in steps(p, "talker", "prefix")]
    assert ("a",) in calls and ("b",) not in calls  # recorded: the calls that succeeded
    assert a[1].of(DoneOut)[0].status == "completed" and a[1].of(AudioOut)
    assert b[1].of(DoneOut)[0].status == "failed" and isinstance(b[1].of(ErrorOut)[0].error, StageError)


@pytest.mark.parametrize("handoff", ["event", "after_step"])
def test_a_scheduler_error_fails_what_the_thinker_admitted_instead_of_hanging_it(handoff):
    p = make(EngineSettings(handoff=handoff))
    real = p.thinker.prefill
    p.thinker.prefill = lambda reqs: []  # a runner that breaks its contract: the loop itself raises
    try:
        r = request("r")
        run(p, r, timeout=5)
        assert r[1].of(DoneOut)[0].status == "failed"
        assert "thinker loop" in str(r[1].of(ErrorOut)[0].error)
        p.thinker.prefill = real
        ok = request("ok")
        run(p, ok)  # the stage keeps serving
        assert ok[1].of(DoneOut)[0].status == "completed"
    finally:
        p.stop()


def test_step_and_yield_logs_stay_bounded():
    p = make(timings=FakeTimings(thinker_decode=0.001))
    p.log_limit = 4
    try:
        for i in range(8):
            run(p, request(f"r{i}", max_output_tokens=3))
    finally:
        p.stop()
    assert 0 < len(p.yields) <= 4 and 0 < len(p.steps) <= 4


def test_a_response_failed_during_its_last_chunk_gets_no_audio_done():
    p = make(EngineSettings(first_chunk_frames=64, max_chunk_frames=64))  # one chunk, at the end
    push = p.code2wav.push

    def failing_push(req, frames):  # another stage (or the session) fails it while this chunk decodes
        p._fail(req, StageError("failed elsewhere"))
        return push(req, frames)

    p.code2wav.push = failing_push
    try:
        r = request("r")
        run(p, r)
    finally:
        p.stop()
    assert r[1].of(DoneOut)[0].status == "failed"
    assert not r[1].of(AudioDoneOut) and not r[1].of(AudioOut)


def test_a_new_conversations_first_chunk_waits_for_one_chunk_not_for_anothers_backlog():
    # Code2Wav (30 ms a chunk, one frame each) is slower than A's frames (one per 10 ms Thinker step), so A
    # keeps a growing backlog of chunks. B arrives after A's third chunk: its first chunk must go next
    # (it has no audio yet), at most the chunk decoding when its frame 0 came ahead of it. One chunk a call
    # (batched, B's first chunk would share A's call: test_code2wav_batches_same_size_chunks_...).
    p = make(
        EngineSettings(chunk_growth=False, first_chunk_frames=1, yield_to_talker_ms=0, code2wav_batch=False),
        FakeTimings(thinker_decode=0.01, code2wav_chunk=0.03),
        reply_len=60,
    )
    b, b_sink = request("b", slot=1)
    a, a_sink = request("a", slot=0)
    # from the Code2Wav thread: B's request is in before A's next chunk
    submit_at(a, a_sink, AudioOut, 3, lambda: p.submit(b))
    try:
        run(p, (a, a_sink))
        assert b_sink.done.wait(20), "B never finished"
    finally:
        p.stop()
    frame0_b = next(s for s in steps(p, "talker", "predict") if "b" in s.request_ids)
    chunks = steps(p, "code2wav", "chunk")
    first_b = next(s for s in chunks if s.request_ids == ("b",))
    a_between = [
        s for s in chunks if s.request_ids == ("a",) and frame0_b.t_end <= s.t_start < first_b.t_start
    ]
    backlog = sum(1 for s in chunks if s.request_ids == ("a",) and s.t_start >= first_b.t_start)
    assert backlog >= 3, "the test needs A to have chunks waiting when B's first chunk goes"
    assert len(a_between) <= 1, f"B's first chunk waited for {len(a_between)} of A's chunks"


def test_code2wav_serves_the_audio_that_runs_dry_first():
    from omni_rt.pipeline.pacing import audio_urgency

    a, _ = request("a")
    b, _ = request("b")
    new, _ = request("new")
    a.t_first_pcm, a.samples = 10.0, 24_000 * 3  # runs dry at 13 s
    b.t_first_pcm, b.samples = 11.0, 24_000 * 1  # runs dry at 12 s: first of those playing
    order = sorted([(a, 5.0), (b, 6.0), (new, 9.0)], key=lambda x: audio_urgency(*x))
    assert [r.id for r, _ in order] == ["new", "b", "a"]


@pytest.mark.parametrize("piece", [64, None])
def test_a_long_prompt_arriving_mid_stream_holds_the_others_for_one_piece(piece):
    # B's 512-token prompt costs 0.5 ms a token (256 ms whole, 32 ms a 64-token piece). A is replying:
    # with pieces its decode steps go on between B's pieces, so no gap between two of them is longer than
    # about a piece; without, one gap holds the whole prefill.
    p = make(
        EngineSettings(prefill_piece_tokens=piece, yield_to_talker_ms=0),
        FakeTimings(thinker_decode=0.002, thinker_prefill=0.002, thinker_prefill_token=0.0005),
        reply_len=120,
    )
    filler = list(range(1000, 1000 + 512 - len(PROMPT)))
    b, b_sink = request("b", slot=1, prompt=PROMPT[:3] + filler + PROMPT[3:])
    a, a_sink = request("a", slot=0)
    submit_at(a, a_sink, TextOut, 5, lambda: p.submit(b))
    try:
        run(p, (a, a_sink))
        assert b_sink.done.wait(20), "B never finished"
    finally:
        p.stop()
    assert len(b.prompt_ids) == 512 and b_sink.of(TextOut), "B must get its reply"
    b_calls = [s for s in p.steps if s.stage == "thinker" and s.kind != "decode" and "b" in s.request_ids]
    assert [s.kind for s in b_calls] == (["piece"] * 7 + ["prefill"] if piece else ["prefill"])
    a_decodes = [s for s in steps(p, "thinker", "decode") if "a" in s.request_ids]
    during = [s for s in a_decodes if b_calls[0].t_start <= s.t_start <= b_calls[-1].t_end]
    gaps = [y.t_start - x.t_end for x, y in zip(a_decodes, a_decodes[1:], strict=False)]
    if piece:
        assert len(during) >= 7  # A decoded between every two of B's pieces
        assert max(gaps) < 0.2, f"A waited {max(gaps) * 1000:.0f} ms (a piece is 32 ms, the whole 256)"
    else:
        assert max(gaps) >= 0.25  # the whole prefill in one gap: what the pieces are for


def test_a_code2wav_call_takes_the_most_urgent_chunk_and_every_due_chunk_no_longer():
    # ragged batching: the most urgent response's chunk (a first chunk before any that plays) sets the
    # call's length; every response with a chunk due that is no longer rides along with its own size,
    # longer ones wait for a call of their own (cut, they would wait for their next frames: 2026-12-03)
    from omni_rt.pipeline.code2wav import AudioSeq, chunk_batch

    playing = [request(f"p{i}")[0] for i in range(4)]
    for i, r in enumerate(playing):  # audio out and playing, the earlier ones running dry first
        r.t_first_pcm, r.samples = 1.0, 24_000 * (i + 1)
    fresh = request("fresh")[0]  # no audio yet: the most urgent
    seqs = [AudioSeq(r) for r in (*playing, fresh)]
    ready = [(seqs[0], 8), (seqs[1], 2), (seqs[2], 16), (seqs[3], 8), (seqs[4], 1)]
    assert chunk_batch(ready, batched=True) == [(seqs[4], 1)]
    assert chunk_batch(ready[:4], batched=True) == [(seqs[0], 8), (seqs[1], 2), (seqs[3], 8)]
    assert chunk_batch(ready[:4], batched=False) == [(seqs[0], 8)]
    assert chunk_batch(ready[:4], batched=True, ragged=False) == [(seqs[0], 8), (seqs[3], 8)]


@pytest.mark.parametrize("ignore_eos", [True, False])
def test_audio_that_ends_before_a_fixed_length_text_wakes_the_thinker(ignore_eos):
    """A fixed-length reply (`ignore_eos`) held at its text lead goes on to its length once its audio ends
    (`pacing.may_decode_text`): the Talker letting go wakes the Thinker (a Progress after the release),
    which no frame would wake again. Another reply's text ends with its audio (Spoken)."""
    t = FakeTimings()
    p = Pipeline(FakeThinker(t, IDS), FakeTalker(t, IDS), FakeCode2Wav(t), EngineSettings(), IDS)
    req, _ = request("r", ignore_eos=ignore_eos)
    seq = TalkerSeq(req)
    TalkerLoop(p)._finish(seq, {req: seq})
    (msg,) = p.thinker_inbox.take(block=False)
    assert type(msg) is (Progress if ignore_eos else Spoken) and msg.req is req
    assert "talker" not in req.holders


@pytest.mark.parametrize("first", [None, 0.15])
def test_a_prompt_that_comes_during_a_prefill_goes_before_text_that_can_wait(first):
    """`prompt_first_s`: A is replying, its audio far ahead of its playback (the fakes run faster than real
    time). C's prompt comes, and B's comes while C is prefilled (B is submitted from C's first token). The
    step after C's prefill takes C (no audio yet: its voice needs the text now) and, with the setting, not
    A, whose text can wait: B is prefilled right after that step. Without the setting A is in that step."""
    p = make(EngineSettings(prompt_first_s=first), FakeTimings(thinker_decode=0.01), reply_len=40)
    a, a_sink = request("a", slot=0)
    b, b_sink = request("b", slot=1)
    c, c_sink = request("c", slot=2)
    submit_at(a, a_sink, TextOut, 12, lambda: p.submit(c))
    submit_at(c, c_sink, TextOut, 1, lambda: p.submit(b))
    try:
        run(p, (a, a_sink))
        assert b_sink.done.wait(20) and c_sink.done.wait(20), "B and C must finish"
    finally:
        p.stop()
    thinker = [s for s in p.steps if s.stage == "thinker"]
    c_prefill = next(i for i, s in enumerate(thinker) if s.kind == "prefill" and "c" in s.request_ids)
    b_prefill = next(i for i, s in enumerate(thinker) if s.kind == "prefill" and "b" in s.request_ids)
    between = thinker[c_prefill + 1 : b_prefill]
    assert [s.kind for s in between] == ["decode"], "one step between the two prefills"
    assert "c" in between[0].request_ids
    assert ("a" in between[0].request_ids) == (first is None)
    assert all(sink.of(TextOut) and sink.of(AudioOut) for sink in (a_sink, b_sink, c_sink))
