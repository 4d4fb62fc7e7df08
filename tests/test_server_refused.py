"""A reply the Session fails leaves the model's context as it was (a failed turn is not recorded), so its
input waits again: the next response answers it, or the client deletes it. Input that fails twice in a
row is deleted by the server (`conversation.item.deleted`), or it would fail every reply after it."""

import json

import pytest

pytest.importorskip("websockets")

import websockets  # noqa: E402
from server_fakes import FakeEngine, user_message  # noqa: E402
from test_server_protocol import recv, until  # noqa: E402
from test_server_speech import RATE_IN, append, spoken_turn  # noqa: E402

from omni_rt.errors import CapacityError, InvalidRequestError, StageError  # noqa: E402
from omni_rt.server import Server, ServerSettings  # noqa: E402


@pytest.fixture
async def served():
    """(engine, socket): a server on a scripted engine, its session.created read."""
    engine = FakeEngine(step_s=0.0, reply="ok")
    async with Server(engine, ServerSettings(port=0)) as server:
        async with websockets.connect(f"ws://127.0.0.1:{server.port}/ws") as ws:
            await recv(ws)
            yield engine, ws


async def added(ws, text: str) -> str:
    """Add a user message; its item id."""
    await ws.send(json.dumps(user_message(text)))
    events = await until(ws, "conversation.item.done")
    return events[-1]["item"]["id"]


async def respond(ws) -> list[dict]:
    await ws.send(json.dumps({"type": "response.create"}))
    return await until(ws, "response.done")


def status(events: list[dict]) -> str:
    return events[-1]["response"]["status"]


async def test_a_refused_reply_leaves_its_input_for_the_next(served):
    engine, ws = served
    await added(ws, "what time is it")
    engine.refuse = [CapacityError("no cache room for this request")]
    events = await respond(ws)
    error = next(e for e in events if e["type"] == "error")["error"]
    assert error["code"] == "CapacityError" and status(events) == "failed"
    # the next reply answers what the refused one could not, with what was added since behind it
    await added(ws, "and the date")
    assert status(await respond(ws)) == "completed"
    assert engine.requests == ["what time is it", "what time is it\nand the date"]
    assert engine.sessions[0].conversation == [("user", "what time is it\nand the date")]


async def test_refused_input_can_be_deleted_before_it_is_answered(served):
    engine, ws = served
    first = await added(ws, "one")
    engine.refuse = [StageError("talker: simulated failure")]
    assert status(await respond(ws)) == "failed"
    await ws.send(json.dumps({"type": "conversation.item.delete", "item_id": first}))
    deleted = await recv(ws)
    assert (deleted["type"], deleted["item_id"]) == ("conversation.item.deleted", first)
    await added(ws, "two")
    assert status(await respond(ws)) == "completed"
    assert engine.requests[-1] == "two"


async def test_input_refused_twice_is_deleted_by_the_server(served):
    engine, ws = served
    too_long = await added(ws, "a turn the context cannot hold")
    engine.refuse = [InvalidRequestError("the prompt is longer than the context")] * 2
    assert status(await respond(ws)) == "failed"
    later = await added(ws, "hello")  # added after the first refusal: refused once only
    events = await respond(ws)
    assert status(events) == "failed"
    assert engine.requests[-1] == "a turn the context cannot hold\nhello"
    # the input that failed both replies goes, and the client is told; what failed once waits
    deleted = await recv(ws)
    assert deleted["type"] == "conversation.item.deleted" and deleted["item_id"] == too_long
    await ws.send(json.dumps({"type": "conversation.item.retrieve", "item_id": too_long}))
    assert (await recv(ws))["error"]["code"] == "invalid_value"
    await ws.send(json.dumps({"type": "conversation.item.retrieve", "item_id": later}))
    assert (await recv(ws))["item"]["id"] == later
    assert status(await respond(ws)) == "completed"
    assert engine.requests[-1] == "hello"


async def test_a_refused_spoken_turn_is_answered_by_the_next_reply(served):
    engine, ws = served
    off = {"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}}
    await ws.send(json.dumps(off))
    await recv(ws)
    speech = spoken_turn(RATE_IN, lead_s=0.0, tail_s=0.1)
    await append(ws, speech)
    await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
    await until(ws, "conversation.item.done")
    engine.refuse = [StageError("thinker: simulated failure")]
    assert status(await respond(ws)) == "failed"
    assert engine.audio_requests == []
    assert status(await respond(ws)) == "completed"
    ((turn, rate),) = engine.audio_requests  # the whole turn, at 16 kHz
    assert rate == 16000 and len(turn) == pytest.approx(len(speech) * 2 // 3, abs=16)
