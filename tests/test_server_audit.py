"""An outside tester's audit of the OpenAI Realtime drop-in: bad requests against a real server (the tiny
preset's real pipeline), each of which must fail only itself, with an `error` that echoes the client's
`event_id`, and lose nothing the user said."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

pytest.importorskip("websockets")

import websockets  # noqa: E402
from server_fakes import FakeEngine, speech_like  # noqa: E402
from test_server_protocol import recv, until  # noqa: E402
from test_server_refused import added, respond  # noqa: E402
from test_server_speech import RATE_IN, append  # noqa: E402

from omni_rt.server import PeerSettings, Server, ServerSettings  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    import omni_rt

    return omni_rt.Engine.load("tiny")  # a 4,096-token context


@pytest.fixture
async def ws(tiny):
    peer = PeerSettings(model="tiny", max_output_tokens=6, max_audio_frames=6)
    async with tiny, Server(tiny, ServerSettings(port=0, peer=peer)) as server:
        async with websockets.connect(f"ws://127.0.0.1:{server.port}/v1/realtime", max_size=None) as ws:
            assert (await recv(ws))["type"] == "session.created"
            yield ws


async def refused(ws, event: dict) -> dict:
    """The error a bad event gets, and nothing else before it."""
    await ws.send(json.dumps(event))
    answer = await recv(ws)
    assert answer["type"] == "error", answer
    assert answer["error"]["event_id"] == event["event_id"]
    return answer["error"]


LONG_INSTRUCTIONS = "Answer as a pirate would. " * 200  # under 16,000 characters, over 4,096 tokens


async def test_instructions_that_cannot_fit_the_context_are_refused_and_the_user_input_kept(ws):
    """Accepted, they failed every reply after them, and the failures deleted what the user had said."""
    first = await added(ws, "my name is Ada")
    update = {"type": "session.update", "event_id": "u1", "session": {"instructions": LONG_INSTRUCTIONS}}
    assert (await refused(ws, update))["param"] == "session.instructions"
    for _ in range(2):  # two replies: a failed input is deleted at its second failure
        assert (await respond(ws))[-1]["response"]["status"] in ("completed", "incomplete")
        await added(ws, "and again")
    await ws.send(json.dumps({"type": "conversation.item.retrieve", "item_id": first}))
    assert (await recv(ws))["type"] == "conversation.item.retrieved"
    # the session's instructions are what they were; a short change still goes
    await ws.send(json.dumps({"type": "session.update", "session": {"instructions": "Be brief."}}))
    assert (await recv(ws))["session"]["instructions"] == "Be brief."


async def test_tools_that_cannot_fit_the_context_are_refused_mid_conversation(ws):
    await added(ws, "hello")
    assert (await respond(ws))[-1]["response"]["status"] in ("completed", "incomplete")
    tools = [
        {"type": "function", "name": f"tool_{i}", "description": "does a thing " * 300, "parameters": {}}
        for i in range(8)
    ]
    update = {"type": "session.update", "event_id": "u2", "session": {"tools": tools}}
    assert (await refused(ws, update))["param"] == "session.tools"
    await added(ws, "still there?")
    events = await respond(ws)
    assert not [e for e in events if e["type"] == "error"]
    assert events[-1]["response"]["status"] in ("completed", "incomplete")


async def test_response_instructions_that_cannot_fit_fail_that_request_alone(ws):
    await added(ws, "what is two and two")
    create = {"type": "response.create", "event_id": "r1", "response": {"instructions": LONG_INSTRUCTIONS}}
    assert (await refused(ws, create))["param"] == "response.instructions"
    assert (await respond(ws))[-1]["response"]["status"] in ("completed", "incomplete")


async def test_a_client_secret_for_instructions_that_cannot_fit_is_refused(tiny):
    openai = pytest.importorskip("openai")
    async with tiny, Server(tiny, ServerSettings(port=0, token="sk-audit")) as server:
        client = openai.AsyncOpenAI(api_key="sk-audit", base_url=f"http://127.0.0.1:{server.port}/v1")
        with pytest.raises(openai.BadRequestError, match="system prompt"):
            await client.realtime.client_secrets.create(
                session={"type": "realtime", "instructions": LONG_INSTRUCTIONS}
            )
        key = await client.realtime.client_secrets.create(session={"type": "realtime", "instructions": "Hi."})
        assert key.session.instructions == "Hi."


def pcm16(seconds: float) -> str:
    voice = (speech_like(1.0, 24000) * 32767).astype("<i2")
    return base64.b64encode(np.tile(voice, int(seconds)).tobytes()).decode()


async def test_an_append_over_the_message_limit_fails_alone(ws):
    """A 40 s recording in one append (OpenAI takes 15 MiB in one) was over the 2 MiB message limit, and
    closed the connection: the conversation went with it."""
    item = await added(ws, "remember this")
    big = {"type": "input_audio_buffer.append", "event_id": "a1", "audio": pcm16(40)}
    error = await refused(ws, big)
    assert error["code"] == "message_too_large"
    await ws.send(json.dumps({"type": "conversation.item.retrieve", "item_id": item}))
    assert (await recv(ws))["type"] == "conversation.item.retrieved"
    assert (await respond(ws))[-1]["response"]["status"] in ("completed", "incomplete")


@pytest.mark.parametrize("detection", [None, {"type": "server_vad", "silence_duration_ms": 800}])
async def test_a_turn_being_spoken_when_turn_detection_changes_is_kept(detection):
    """The change used to drop the half-heard turn: the client, told `speech_started`, heard nothing more
    of its item, and the words were lost (a framework turning server VAD off mid-turn commits the rest)."""
    engine = FakeEngine(step_s=0.0, reply="ok")
    async with Server(engine, ServerSettings(port=0)) as server:
        async with websockets.connect(f"ws://127.0.0.1:{server.port}/ws") as ws:
            await recv(ws)  # session.created
            voice = np.concatenate([np.zeros(int(0.2 * RATE_IN), np.float32), speech_like(1.0, RATE_IN)])
            await append(ws, voice)  # no pause: the turn is still open
            item = (await until(ws, "input_audio_buffer.speech_started"))[-1]["item_id"]
            turn_detection = {"audio": {"input": {"turn_detection": detection}}}
            await ws.send(json.dumps({"type": "session.update", "session": turn_detection}))
            events = await until(ws, "session.updated")
            kinds = [e["type"] for e in events]
            assert kinds[:3] == ["input_audio_buffer.speech_stopped", "input_audio_buffer.committed",
                                 "conversation.item.added"], kinds  # fmt: skip
            assert events[0]["item_id"] == item and events[1]["item_id"] == item
            assert "response.created" not in kinds  # it waits: the new settings did not hear it begin
            await ws.send(json.dumps({"type": "response.create"}))
            assert (await until(ws, "response.done"))[-1]["response"]["status"] == "completed"
            ((turn, rate),) = engine.audio_requests
            assert rate == 16000 and abs(len(turn) - int(1.2 * rate)) <= 32 * 16  # all of it, whole frames
