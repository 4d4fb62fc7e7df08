"""The embedding API misused as a demanding app would: each test is a defect an audit found. Bad input is a
clear, typed error that loses nothing (the engine, other sessions, the conversation); nothing hangs.

Fake stages (test_session.fake_engine): fast, ordered by events, never by sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from test_session import TOK, collect, fake_engine, types

import omni_rt
from omni_rt.config import StageSampling


async def test_a_second_respond_while_the_first_reports_a_truncation_is_refused():
    # the first response yielded conversation.truncated before it was submitted: a respond() from another
    # task at that moment found no response in progress, and both ran on the session's one cache slot
    async with fake_engine(reply_len=10, max_context=128) as engine, engine.session() as s:
        while not any(e.type == "conversation.truncated" for e in await collect(s, "a turn of some words")):
            pass
        intruder: list[asyncio.Task] = []

        async def on_event(ev):
            if ev.type == "conversation.truncated":
                intruder.append(asyncio.create_task(collect(s, "intruder")))
                await asyncio.sleep(0)  # the intruder's respond() runs as far as it can

        first = await collect(s, "a longer turn of many more words", on_event=on_event)
        second = await intruder[0]
        assert types(first)[:2] == ["response.created", "conversation.truncated"]
        assert first[-1].status == "completed"
        assert second[-1].status == "failed" and "in progress" in second[1].error.message
        assert TOK.last_turn(s.conversation, "user") == "a longer turn of many more words"


async def test_leaving_the_loop_at_a_truncation_keeps_the_turn():
    # as leaving it at any later event: the response is cancelled and what the user said stays (the older
    # turns were dropped for it and the turn itself was lost)
    async with fake_engine(reply_len=10, max_context=128) as engine, engine.session() as s:
        while not any(e.type == "conversation.truncated" for e in await collect(s, "a turn of some words")):
            pass
        async with contextlib.aclosing(s.respond("what I said last, in rather more words")) as stream:
            async for ev in stream:
                if ev.type == "conversation.truncated":
                    break
        await s.cancel()  # returns once the dropped response has stopped
        assert TOK.last_turn(s.conversation, "user") == "what I said last, in rather more words"
        assert (await collect(s, "and then"))[-1].status == "completed"


async def test_closing_a_session_ends_its_response_waiting_for_admission():
    # it waited out admission_wait_s and then failed with session_limit, for a session its app had closed
    async with fake_engine(max_sessions=1, admission_wait_s=600.0) as engine, engine.session():
        s = engine.session()  # queued
        created = asyncio.Event()
        waiting = asyncio.create_task(collect(s, "hello", on_event=lambda ev: created.set()))
        await created.wait()  # its respond() waits for a slot from here
        await s.close()
        events = await asyncio.wait_for(waiting, 30)  # far less than admission_wait_s
        assert types(events) == ["response.created", "response.done"]
        assert events[-1].status == "cancelled"
        assert engine.capacity.waiting == 0


@pytest.mark.parametrize(
    "bad",
    [
        {"temperature": float("inf")},
        {"temperature": 1e300},
        {"repetition_penalty": 1e300},
        {"top_k": 10**30},
    ],
)
def test_sampling_values_the_stage_samplers_cannot_hold_are_refused(bad):
    # 1e300 and 10**30 passed, then failed the Thinker's batched prefill: every session's reply in it
    with pytest.raises(ValueError):
        StageSampling(**bad)


def test_the_largest_sampling_values_accepted_fit_the_stage_samplers():
    from omni_rt.model.sampling import StageSampler

    f32_max = 3.4028234663852886e38
    largest = StageSampling(temperature=f32_max, top_k=2**63 - 1, repetition_penalty=f32_max)
    StageSampler("thinker", 1, 16).assign(0, largest, seed=0)


async def test_an_inner_async_with_leaves_the_engine_running_for_the_outer_one():
    engine = fake_engine(reply_len=4)
    async with engine:
        async with engine:  # a library helper that also scopes the engine it was given
            pass
        assert engine.running
        async with engine.session() as s:
            assert (await collect(s, "still here"))[-1].status == "completed"
    assert not engine.running


async def test_overlapping_async_with_blocks_stop_the_engine_at_the_last_exit():
    engine = fake_engine(reply_len=4)
    entered, leave = asyncio.Event(), asyncio.Event()

    async def other_user():
        async with engine:
            entered.set()
            await leave.wait()

    task = asyncio.create_task(other_user())
    async with engine:
        await entered.wait()
        leave.set()
        await task  # its block ends first
        assert engine.running
    assert not engine.running


@pytest.mark.parametrize("voice", [None, 5, ["ethan"]])
async def test_a_voice_that_is_not_a_string_is_a_typed_error(voice):
    async with fake_engine() as engine:
        with pytest.raises(omni_rt.InvalidRequestError, match="voice"):
            engine.session(voice=voice)  # an AttributeError
        assert engine.capacity.sessions == 0


async def test_a_closed_session_entered_again_says_it_is_closed():
    # it raised SessionLimitError ("all 4 session slots are in use") with every slot free
    async with fake_engine() as engine:
        s = engine.session()
        async with s:
            pass
        with pytest.raises(omni_rt.InvalidRequestError, match="closed"):
            async with s:
                pass


async def test_releasing_a_speculation_twice_changes_nothing():
    # the second release committed the first turn again over the turns after it, forgot another held
    # speculation (a respond() then ran beside it on the slot), and its iterator never ended
    async with fake_engine(reply_len=4) as engine, engine.session() as s:
        spec = s.speculate("first")
        while spec._hold.resp is None or not spec._hold.resp.done.is_set():
            await asyncio.sleep(0)  # it finishes while held: its turn commits at release
        assert [ev async for ev in spec.release()][-1].status == "completed"
        assert (await collect(s, "second"))[-1].status == "completed"
        held = s.speculate("third")
        with pytest.raises(RuntimeError, match="released"):
            spec.release()
        assert TOK.last_turn(s.conversation, "user") == "second"
        assert "held" in (await collect(s, "fourth"))[1].error.message
        await held.drop()
