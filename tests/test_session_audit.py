"""The embedding API misused as a demanding app would: each test is a defect an audit found. Bad input is a
clear, typed error that loses nothing (the engine, other sessions, the conversation); nothing hangs.

Fake stages (test_session.fake_engine): fast, ordered by events, never by sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib

from test_session import TOK, collect, fake_engine, types


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
