"""A device that stops making progress ends every response with `engine_stalled`, not silence."""

from __future__ import annotations

import json
import threading

import pytest
from server_fakes import FakeEngine
from test_pipeline_policy import IDS, make, request
from test_server_static import http, req

from omni_rt.config import EngineSettings
from omni_rt.errors import EngineStalledError
from omni_rt.pipeline.fake import FakeTalker, FakeTimings
from omni_rt.pipeline.request import AudioOut, DoneOut, ErrorOut
from omni_rt.server import Server, ServerSettings


class StoppingTalker(FakeTalker):
    """A Talker whose device stops at its second step: the call blocks until `resume` is set (as a
    read-back blocks inside CUDA while the GPU never finishes)."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.resume = threading.Event()
        self.steps_taken = 0

    def step(self, reqs, frames, text_ids):
        self.steps_taken += 1
        if self.steps_taken == 2:
            self.resume.wait()
        return super().step(reqs, frames, text_ids)


def test_a_stage_call_that_never_returns_ends_every_response_with_engine_stalled(capfd):
    t = FakeTimings()
    talker = StoppingTalker(t, IDS)
    p = make(EngineSettings(stall_timeout_s=0.3), t, talker_stage=talker)
    try:
        reqs = [request(f"r{i}", slot=i) for i in range(2)]
        for r, _ in reqs:
            p.submit(r)
        for _, sink in reqs:
            assert sink.done.wait(10), "a response was left waiting on a stopped device"
            (err,) = sink.of(ErrorOut)
            assert isinstance(err.error, EngineStalledError) and err.error.code == "engine_stalled"
            assert "talker" in str(err.error)
            assert isinstance(sink.msgs[-1][1], DoneOut)  # the error, then its done: nothing after
        assert isinstance(p.stall, EngineStalledError)
        late, _ = request("late", slot=0)
        with pytest.raises(EngineStalledError):  # refused at once, not queued behind the stopped stage
            p.submit(late)
        logged = capfd.readouterr().err
        assert "the talker stage has not returned" in logged and "File " in logged  # the stacks
        # the device comes back: the stage finds its responses let go and posts nothing more
        before = [len(s.msgs) for _, s in reqs]
        talker.resume.set()
    finally:
        talker.resume.set()
        p.stop()
    assert [len(s.msgs) for _, s in reqs] == before, [
        s.msgs[b:] for (_, s), b in zip(reqs, before, strict=True)
    ]


def test_long_responses_of_quick_steps_are_no_stall():
    # the watch times one stage iteration, not a response: 8 tokens of 0.1 s each outlast the timeout
    t = FakeTimings(thinker_decode=0.1, talker_step=0.05)
    p = make(EngineSettings(stall_timeout_s=0.4), t)
    try:
        r, sink = request("r0")
        p.submit(r)
        assert sink.done.wait(20)
        assert not sink.of(ErrorOut) and sink.of(AudioOut) and p.stall is None
    finally:
        p.stop()


async def test_health_says_503_with_the_stall():
    engine = FakeEngine()
    engine.stall = EngineStalledError("the talker stage has not returned from its call for 31 s")
    async with Server(engine, ServerSettings(port=0)) as server:
        status, _, body = await http(server.port, req("GET", b"/health"))
    health = json.loads(body)
    assert status == 503 and health["ok"] is False and health["error"]["code"] == "engine_stalled"


async def test_the_user_of_a_stalled_engine_gets_engine_stalled_and_no_hang():
    # the real tiny engine; its Code2Wav call blocks from the second chunk on, as a read-back blocks in
    # CUDA while the GPU never finishes: the response ends failed with engine_stalled, and so does the next
    import omni_rt

    engine = omni_rt.Engine.load("tiny", stall_timeout_s=0.5)
    resume = threading.Event()
    async with engine:
        runner = engine.pipeline.code2wav
        real, calls = runner.push_many, []

        def stopping(reqs, frames):
            calls.append(len(reqs))
            if len(calls) == 2:
                resume.wait()
            return real(reqs, frames)

        runner.push_many = stopping
        try:
            async with engine.session() as s:
                events = [ev async for ev in s.respond("Hello there.", max_audio_frames=40)]
                done = events[-1]
                assert done.type == "response.done" and done.status == "failed"
                assert done.error.code == "engine_stalled" and engine.stall is not None
                again = [ev async for ev in s.respond("Are you there?")]
                assert again[-1].type == "response.done" and again[-1].error.code == "engine_stalled"
        finally:
            resume.set()


def test_a_stalled_replica_fails_its_health_check_so_serve_restarts_it():
    import types

    replica_mod = pytest.importorskip("omni_rt.cluster.replica")
    check = replica_mod.OmniReplica.check_health  # on only what it reads: a replica needs Ray Serve
    replica = types.SimpleNamespace(replica_id="r1", engine=types.SimpleNamespace(running=True, stall=None))
    check(replica)  # healthy: no error
    replica.engine.stall = EngineStalledError("the thinker stage has not returned from its call for 61 s")
    with pytest.raises(RuntimeError, match="thinker stage has not returned"):
        check(replica)


def test_a_stall_report_names_the_native_frames_where_py_spy_can_attach():
    # A Python stack ends at the torch call; the native frames say which CUDA call a thread waits in.
    import shutil

    from omni_rt.pipeline.watchdog import native_stacks

    if shutil.which("py-spy") is None:
        assert native_stacks() is None
        pytest.skip("py-spy is not installed here")
    out = native_stacks()
    if "Permission" in out or "permission" in out:
        pytest.skip(f"py-spy may not attach here: {out[-200:]}")
    assert "native_stacks" in out and "libc" in out  # this very call, down to its native wait
