"""Admission control (omni_rt.admission): the ceiling of sessions, its typed error, the bounded FIFO wait
(`admission_wait_s`) and its cancellation, the KV-memory ceiling (`kv_cache_gib`), `Engine.capacity`;
and the Session's narrow view of the engine (omni_rt.host): no engine privates, no import of engine.py.

Waits are ordered by events (a queued request is queued at `engine.session()`, a slot comes back at
`close()`); only the deadline test waits for its (short) deadline.
"""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import pytest

import omni_rt
from omni_rt.admission import GIB, Slots, check_kv_ceiling, kv_bytes_per_slot, kv_cache_bytes
from omni_rt.engine import Engine
from omni_rt.errors import CapacityError, ConfigError, SessionLimitError
from omni_rt.events import ErrorEvent
from omni_rt.model.config import preset
from omni_rt.pipeline.fake import FakeCode2Wav, FakeTalker, FakeThinker, FakeTimings
from omni_rt.tokenizer import Tokenizer

CFG = preset("tiny")
TOK = Tokenizer.tiny(CFG.ids)
LONG = 20.0  # a wait no test reaches: every admission below comes from a close()


def fake_engine(**settings) -> Engine:
    t = FakeTimings(thinker_prefill=0.001, thinker_decode=0.001, talker_prefix=0.001)

    def stages(s):
        return FakeThinker(t, CFG.ids, reply_len=3), FakeTalker(t, CFG.ids), FakeCode2Wav(t)

    return Engine(CFG, TOK, stages, omni_rt.EngineSettings(**settings))


async def collect(session, *args, **kw) -> list:
    return [ev async for ev in session.respond(*args, **kw)]


# -- the ceiling and its error -------------------------------------------------------------------------


def test_the_limit_is_a_typed_error_with_the_documented_code():
    slots = Slots(2)
    a, b = slots.request(), slots.request()
    assert (a.slot, b.slot, slots.in_use) == (0, 1, 2)
    with pytest.raises(SessionLimitError, match="all 2 session slots are in use") as refused:
        slots.request()
    assert isinstance(refused.value, CapacityError)  # code that catches the broader class still does
    assert refused.value.code == "session_limit"
    assert ErrorEvent.from_exception(refused.value).error.code == "session_limit"
    assert ErrorEvent.from_exception(CapacityError("x")).error.code == "CapacityError"  # others: the name
    a.close()
    a.close()  # idempotent: the slot is not given back twice
    assert slots.in_use == 1 and slots.request().slot == 0


async def test_a_session_beyond_the_limit_is_refused_at_once_by_default():
    async with fake_engine(max_sessions=1) as engine:
        async with engine.session():
            with pytest.raises(SessionLimitError):
                engine.session()
            assert engine.capacity.waiting == 0  # nothing queued
        async with engine.session() as s:  # the slot came back at close
            assert (await collect(s, "hi"))[-1].status == "completed"


# -- the bounded wait ----------------------------------------------------------------------------------


async def test_a_queued_session_is_admitted_when_another_closes_first_come_first_served():
    async with fake_engine(max_sessions=2, admission_wait_s=LONG) as engine:
        held = [engine.session(), engine.session()]
        first, second = engine.session(), engine.session()  # queued, in this order
        assert (first.slot, second.slot, engine.capacity.waiting) == (None, None, 2)
        entering = [asyncio.create_task(s.__aenter__()) for s in (second, first)]  # entered out of order
        await held[1].close()
        assert await entering[1] is first and first.slot == 1  # the older request got the slot
        assert not entering[0].done() and engine.capacity.waiting == 1
        await held[0].close()
        assert await entering[0] is second and second.slot == 0
        for s in (first, second):
            assert (await collect(s, "hi"))[-1].status == "completed"
            await s.close()
        assert engine.capacity.sessions == 0


async def test_a_queued_session_used_without_async_with_is_admitted_by_respond():
    async with fake_engine(max_sessions=1, admission_wait_s=LONG) as engine:
        holder = engine.session()
        waiting = engine.session()
        reply = asyncio.create_task(collect(waiting, "hello"))
        await holder.close()
        events = await reply
        assert events[0].type == "response.created" and events[-1].status == "completed"
        await waiting.close()


async def test_the_wait_is_bounded_then_the_same_error():
    async with fake_engine(max_sessions=1, admission_wait_s=0.05) as engine, engine.session():
        late = engine.session()
        with pytest.raises(SessionLimitError, match="after waiting 0.05 s"):
            await late.__aenter__()
        assert engine.capacity.waiting == 0
        failed = await collect(engine.session(), "hi")  # through respond(): an error event, then done
        assert [e.type for e in failed] == ["response.created", "error", "response.done"]
        assert failed[1].error.code == "session_limit" and failed[-1].status == "failed"


async def test_a_cancelled_waiter_leaks_no_slot():
    async with fake_engine(max_sessions=1, admission_wait_s=LONG) as engine:
        holder = engine.session()
        gone, next_ = engine.session(), engine.session()
        entering = asyncio.create_task(gone.__aenter__())
        admitted = asyncio.create_task(next_.__aenter__())
        await asyncio.sleep(0)  # both are waiting on their tickets
        entering.cancel()
        with pytest.raises(asyncio.CancelledError):
            await entering
        assert engine.capacity.waiting == 1
        await holder.close()
        assert await admitted is next_  # the cancelled one's place went to the next
        await next_.close()
        await gone.close()  # closing the cancelled one gives nothing back twice
        assert engine.capacity.sessions == 0 and engine.capacity.waiting == 0


async def test_a_slot_granted_to_a_waiter_cancelled_before_it_woke_goes_on():
    slots = Slots(1, wait_s=LONG)
    owner = slots.request()
    late, later = slots.request(), slots.request()
    waits = [asyncio.create_task(t.wait()) for t in (late, later)]
    await asyncio.sleep(0)  # both wait
    owner.close()  # the slot is late's now, but late has not run yet
    assert late.slot == 0
    waits[0].cancel()
    assert await waits[1] == 0 and later.slot == 0  # it went on to the next instead of leaking
    assert waits[0].cancelled()
    later.close()
    assert slots.in_use == 0


async def test_closing_a_queued_session_leaves_the_queue():
    async with fake_engine(max_sessions=1, admission_wait_s=LONG) as engine:
        holder = engine.session()
        queued = engine.session()
        await queued.close()
        assert engine.capacity.waiting == 0
        await holder.close()
        assert engine.capacity.sessions == 0  # the slot went back to the free list, not to the closed one


# -- the memory ceiling and the capacity ---------------------------------------------------------------


def test_the_kv_ceiling_says_how_many_sessions_fit():
    settings = omni_rt.EngineSettings(max_sessions=3, max_context=256, max_talker_context=128)
    three = kv_cache_bytes(CFG, settings, 2)
    check_kv_ceiling(CFG, settings.model_copy(update={"kv_cache_gib": three / GIB}), 2)  # exactly fits
    tight = settings.model_copy(update={"max_sessions": 8, "kv_cache_gib": three / GIB})
    with pytest.raises(ConfigError, match="3 sessions fit"):
        check_kv_ceiling(CFG, tight, 2)
    # an engine made without a model counts float32 items: twice the bytes, so twice the budget fits 3
    with pytest.raises(ConfigError, match="3 sessions fit"):
        Engine(CFG, TOK, lambda s: None, tight.model_copy(update={"kv_cache_gib": three * 2 / GIB}))
    # per slot: k and v of every Thinker and Talker layer at their contexts, and the code predictor's
    th, tk, cp = CFG.thinker, CFG.talker, CFG.code_predictor
    per = (
        2
        * 2
        * (
            th.num_hidden_layers * th.num_key_value_heads * th.head_dim * 256
            + tk.num_hidden_layers * tk.num_key_value_heads * tk.head_dim * 128
            + cp.num_hidden_layers * cp.num_key_value_heads * cp.head_dim * CFG.num_code_groups
        )
    )
    assert kv_bytes_per_slot(CFG, settings, 2) == per


def test_load_refuses_a_kv_ceiling_before_building_the_model(monkeypatch):
    from omni_rt.model.omni import OmniModel

    def never(*args, **kwargs):
        raise AssertionError("the model was built before the ceiling was checked")

    monkeypatch.setattr(OmniModel, "build", never)
    with pytest.raises(ConfigError, match="0 sessions fit"):
        omni_rt.Engine.load("tiny", kv_cache_gib=1e-6)


async def test_capacity_counts_what_the_runners_allocate():
    engine = omni_rt.Engine.load("tiny", max_sessions=2, max_context=64, max_talker_context=32)
    async with engine:
        async with engine.session():
            cap = engine.capacity
            assert (cap.sessions, cap.max_sessions, cap.waiting) == (1, 2, 0)
            p = engine.pipeline
            caches = (p.thinker.cache, p.talker.cache, p.talker.talker.code_predictor.cache)
            assert cap.kv_bytes == sum(c.k.nbytes + c.v.nbytes for c in caches)
            assert cap.kv_bytes_per_slot == kv_bytes_per_slot(CFG, engine.settings, 4)  # float32
            assert cap.as_dict()["kv_bytes"] == cap.kv_bytes
        assert engine.capacity.sessions == 0


# -- the Session's view of the engine ------------------------------------------------------------------

SESSION_SIDE = ("session.py", "speculation.py", "response_stream.py", "live_speech.py", "turn_input.py")


@pytest.mark.parametrize("name", SESSION_SIDE)
def test_the_session_side_reaches_the_engine_only_through_its_host(name):
    tree = ast.parse((Path(omni_rt.__file__).parent / name).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert node.module not in ("omni_rt.engine", "omni_rt.pipeline.scheduler"), node.module
        if isinstance(node, ast.Import):
            assert not any(a.name in ("omni_rt.engine", "omni_rt.pipeline.scheduler") for a in node.names)
        if isinstance(node, ast.Attribute):
            assert node.attr != "engine", f"{name}:{node.lineno} reads an engine"
            if isinstance(node.value, ast.Attribute) and node.value.attr == "_host":
                assert not node.attr.startswith("_"), f"{name}:{node.lineno}: a private of the host"
