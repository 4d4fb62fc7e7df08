"""Function calling with a scripted Thinker: tools reach the system turn, `<tool_call>` becomes a
function_call item (never spoken), its output is fed back, and a malformed call fails closed."""

import asyncio
import json

import pytest

pytest.importorskip("websockets")

import websockets  # noqa: E402
from openai_check import validate  # noqa: E402
from server_fakes import FakeEngine, user_message  # noqa: E402

from omni_rt.server import Server, ServerSettings  # noqa: E402
from omni_rt.tools import TOOL_CALL, TOOL_CALL_END, ToolCallParser  # noqa: E402

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def call_script(body: str) -> list[tuple[str, list[int]]]:
    """The Thinker's deltas of a reply that is one call: the special tokens decode to nothing."""
    return [("", [TOOL_CALL]), *[(c, [1000 + i]) for i, c in enumerate(body)], ("", [TOOL_CALL_END])]


async def recv(ws) -> dict:
    return validate(await asyncio.wait_for(ws.recv(), 5))


async def until(ws, type_: str) -> list[dict]:
    events = [await recv(ws)]
    while events[-1]["type"] != type_:
        events.append(await recv(ws))
    return events


@pytest.fixture
async def served():
    engine = FakeEngine(step_s=0.0)
    async with Server(engine, ServerSettings(port=0)) as server:
        async with websockets.connect(f"ws://127.0.0.1:{server.port}/v1/realtime?model=m") as ws:
            await recv(ws)
            await ws.send(
                json.dumps(
                    {"type": "session.update", "session": {"tools": [WEATHER], "instructions": "Help."}}
                )
            )
            updated = await recv(ws)
            assert updated["type"] == "session.updated"
            yield engine, ws


async def test_a_tool_call_becomes_a_function_call_item_and_its_output_goes_back(served):
    engine, ws = served
    # The tools are in the system turn, as Qwen3-Omni's chat template writes them.
    system = engine.instructions[-1]
    assert system.startswith("Help.\n\n# Tools") and '"name": "get_weather"' in system
    assert "<tool_call>" in system and "</tools>" in system

    engine.script = call_script('{"name": "get_weather", "arguments": {"city": "Paris"}}')
    await ws.send(json.dumps(user_message("Weather in Paris?")))
    await ws.send(json.dumps({"type": "response.create"}))
    events = await until(ws, "response.done")
    types = [e["type"] for e in events]
    # Nothing of the call is spoken or shown.
    spoken = (
        "response.output_audio.delta",
        "response.output_audio_transcript.delta",
        "response.output_text.delta",
    )
    assert not [t for t in types if t in spoken]
    assert "response.content_part.added" not in types
    added = next(e for e in events if e["type"] == "response.output_item.added")["item"]
    assert added["type"] == "function_call" and added["name"] == "get_weather"
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert json.loads(done["arguments"]) == {"city": "Paris"} and done["call_id"] == added["call_id"]
    response = events[-1]["response"]
    assert response["status"] == "completed"
    assert [(i["type"], i["call_id"]) for i in response["output"]] == [("function_call", added["call_id"])]

    # The result goes back as the template's tool response; the next reply answers it.
    engine.script = None
    engine.reply = "It is sunny."
    output = {"type": "function_call_output", "call_id": added["call_id"], "output": '{"sky": "clear"}'}
    await ws.send(json.dumps({"type": "conversation.item.create", "item": output}))
    echoed = (await until(ws, "conversation.item.done"))[-1]
    assert echoed["item"]["type"] == "function_call_output" and echoed["previous_item_id"] == added["id"]
    await ws.send(json.dumps({"type": "response.create"}))
    events = await until(ws, "response.done")
    assert engine.requests[-1] == '<tool_response>\n{"sky": "clear"}\n</tool_response>'
    assert events[-1]["response"]["output"][0]["content"][0]["transcript"] == "It is sunny."


@pytest.mark.parametrize(
    "body",
    [
        '{"name": "get_weather", "arguments": {"city": ',  # not JSON
        '{"name": "rm_rf", "arguments": {}}',  # not a tool of the session
        '{"name": "get_weather", "arguments": [1]}',  # arguments not an object
    ],
)
async def test_a_malformed_tool_call_fails_closed(served, body):
    engine, ws = served
    engine.script = call_script(body)
    await ws.send(json.dumps(user_message("Weather?")))
    await ws.send(json.dumps({"type": "response.create"}))
    events = await until(ws, "response.done")
    types = [e["type"] for e in events]
    assert [e["error"]["code"] for e in events if e["type"] == "error"] == ["invalid_tool_call"]
    assert "response.output_item.added" not in types and "response.output_audio.delta" not in types
    assert events[-1]["response"]["status"] == "failed" and events[-1]["response"]["output"] == []


class Pulled(list):
    """A script that says when the Thinker took its delta `at`: the ones before it have been handled."""

    def __init__(self, deltas, at: int, reached: asyncio.Event | None = None) -> None:
        super().__init__(deltas)
        self.at, self.reached = at, reached or asyncio.Event()

    def __getitem__(self, index):
        if not isinstance(index, slice):
            return super().__getitem__(index)
        return Pulled(super().__getitem__(index), self.at, self.reached)

    def __iter__(self):
        for i, delta in enumerate(super().__iter__()):
            if i == self.at:
                self.reached.set()
            yield delta


async def test_a_reply_cancelled_inside_a_tool_call_is_cancelled_not_a_malformed_call(served):
    """response.cancel while the model was writing a call: the reply was cut, not malformed. It was an
    `invalid_tool_call` error ("the reply ended inside a <tool_call>") beside the cancelled response, as
    if the model had left the call open (the adapters tell the two apart)."""
    engine, ws = served
    body = '{"name": "get_weather", "arguments": {"city": "' + "x" * 200 + '"}}'
    engine.script = Pulled(call_script(body), at=3)
    await ws.send(json.dumps(user_message("Weather?")))
    await ws.send(json.dumps({"type": "response.create"}))
    assert (await recv(ws))["type"] == "conversation.item.added"
    await until(ws, "response.created")
    await asyncio.wait_for(engine.script.reached.wait(), 5)  # inside the call
    await ws.send(json.dumps({"type": "response.cancel"}))
    events = await until(ws, "response.done")
    assert [e for e in events if e["type"] == "error"] == []
    assert events[-1]["response"]["status"] == "cancelled" and events[-1]["response"]["output"] == []


def test_the_parser_speaks_text_before_a_call_and_nothing_after():
    parser = ToolCallParser(frozenset({"f"}))
    assert parser.feed("Let me check.", [1]) == ("Let me check.", [])
    assert parser.feed("", [TOOL_CALL]) == ("", [])
    assert parser.calling
    assert parser.feed('{"name": "f", "arguments": {}}', [2]) == ("", [])
    speak, calls = parser.feed("", [TOOL_CALL_END])
    assert speak == "" and [(c.name, c.arguments) for c in calls] == [("f", "{}")]
    assert parser.feed(" more", [3]) == ("", [])  # after a call: not spoken
    parser.feed("", [TOOL_CALL])
    assert [type(b).__name__ for b in parser.end()] == ["BadToolCall"]  # left open


async def test_tools_with_one_name_twice_are_invalid_and_change_nothing(served):
    """Two tools of one name (a call of it would run either) were both offered: now invalid_value."""
    engine, ws = served
    news = {**WEATHER, "description": "The news."}
    await ws.send(json.dumps({"type": "session.update", "session": {"tools": [WEATHER, news]}}))
    error = (await recv(ws))["error"]
    assert (error["code"], error["param"]) == ("invalid_value", "session.tools")
    assert "'get_weather'" in error["message"]
    await ws.send(json.dumps({"type": "session.update", "session": {}}))
    assert (await recv(ws))["session"]["tools"] == [WEATHER]


def test_a_call_too_long_is_one_malformed_call_not_two():
    """Past MAX_CALL_CHARS the call is malformed; its closing token then was a second error ("a
    </tool_call> without its <tool_call>") for the same call."""
    from omni_rt.tools import MAX_CALL_CHARS

    parser = ToolCallParser(frozenset({"f"}))
    parser.feed("", [TOOL_CALL])
    bad = [c for _ in range(MAX_CALL_CHARS // 100 + 2) for c in parser.feed("x" * 100, [2])[1]]
    assert len(bad) == 1 and "longer" in bad[0].message
    assert parser.feed("", [TOOL_CALL_END]) == ("", []) and parser.end() == []
    parser.feed("", [TOOL_CALL])  # a call after it is read as any other
    assert [c.name for c in parser.feed('{"name": "f"}', [3])[1] + parser.feed("", [TOOL_CALL_END])[1]] == [
        "f"
    ]


async def test_items_are_retrieved_and_unanswered_ones_deleted(served):
    engine, ws = served
    await ws.send(json.dumps(user_message("first")))
    first = (await until(ws, "conversation.item.done"))[-1]["item"]
    await ws.send(json.dumps(user_message("second")))
    second = (await until(ws, "conversation.item.done"))[-1]["item"]
    await ws.send(json.dumps({"type": "conversation.item.retrieve", "item_id": first["id"]}))
    assert (await recv(ws))["item"] == first
    await ws.send(json.dumps({"type": "conversation.item.delete", "item_id": second["id"]}))
    assert (await recv(ws)) | {"event_id": None} == {
        "type": "conversation.item.deleted",
        "item_id": second["id"],
        "event_id": None,
    }
    await ws.send(json.dumps({"type": "response.create"}))
    await until(ws, "response.done")
    assert engine.requests[-1] == "first"  # the deleted item never reached the model
    # Answered input is in the model's context: deleting it is refused, clearly.
    await ws.send(json.dumps({"type": "conversation.item.delete", "item_id": first["id"], "event_id": "d"}))
    error = (await recv(ws))["error"]
    assert (error["code"], error["event_id"]) == ("item_delete_unsupported", "d")


async def test_the_session_shows_its_tools_and_refuses_a_choice_of_none_of_them(served):
    """session.updated is the full configuration in effect (OpenAI's words): it left out the tools and
    the tool choice; and a tool_choice naming no tool of the session was taken, then asked of the model."""
    _, ws = served
    await ws.send(json.dumps({"type": "session.update", "session": {"tool_choice": "required"}}))
    session = (await recv(ws))["session"]
    assert session["tools"] == [WEATHER] and session["tool_choice"] == "required"
    choice = {"type": "function", "name": "get_time"}
    await ws.send(
        json.dumps({"type": "session.update", "event_id": "c1", "session": {"tool_choice": choice}})
    )
    error = (await recv(ws))["error"]
    assert (error["code"], error["param"], error["event_id"]) == (
        "invalid_value",
        "session.tool_choice.name",
        "c1",
    )
    await ws.send(json.dumps({"type": "session.update", "session": {"tools": []}}))
    session = (await recv(ws))["session"]
    assert session["tools"] == [] and session["tool_choice"] == "required"


async def test_a_reply_asked_for_with_the_sessions_own_tools_goes_ahead(served):
    """livekit's OpenAI plugin asks for the reply after a tool call with the session's tools in
    response.create: refused, the tool's result was never spoken. The same tools are no change; other
    tools, or another tool_choice, would need another system turn and stay refused."""
    engine, ws = served
    await ws.send(json.dumps(user_message("Weather in Paris?")))
    same = {"tools": [WEATHER], "tool_choice": "auto"}
    await ws.send(json.dumps({"type": "response.create", "response": same}))
    events = await until(ws, "response.done")
    assert events[-1]["response"]["status"] == "completed" and engine.requests[-1] == "Weather in Paris?"
    other = dict(WEATHER, name="get_time")
    for event_id, response, param in (
        ("t1", {"tools": [WEATHER, other]}, "response.tools"),
        ("t2", {"tools": [WEATHER], "tool_choice": "required"}, "response.tool_choice"),
    ):
        await ws.send(json.dumps({"type": "response.create", "event_id": event_id, "response": response}))
        error = (await recv(ws))["error"]
        assert (error["code"], error["param"], error["event_id"]) == ("unsupported_value", param, event_id)


async def test_new_instructions_and_tools_mid_conversation_keep_the_conversation(served):
    """session.update of instructions, tools or voice once the conversation had begun opened a fresh
    Session: everything said was gone (pipecat and livekit change instructions mid-call). Now the
    Session stays; the next reply carries the new system prompt as a system turn, once, and the voice."""
    engine, ws = served
    opened = len(engine.sessions)

    async def reply(text: str) -> None:
        await ws.send(json.dumps(user_message(text)))
        await ws.send(json.dumps({"type": "response.create"}))
        assert (await until(ws, "response.done"))[-1]["response"]["status"] == "completed"

    await reply("one")
    await ws.send(
        json.dumps({"type": "session.update", "session": {"instructions": "Be terse.", "voice": "chelsie"}})
    )
    assert (await recv(ws))["type"] == "session.updated"
    await reply("two")
    await reply("three")
    assert len(engine.sessions) == opened  # the same Session throughout
    assert engine.requests[-2:] == ["two", "three"] and engine.voices[-2:] == ["chelsie", "chelsie"]
    first, second, third = engine.turn_instructions[-3:]
    assert first is None and third is None  # the session's first turn said "Help.", and "two" the new one
    assert second.startswith("Be terse.\n\n# Tools") and '"name": "get_weather"' in second
    # a system message item makes the reply's prompt chat-formatted: the due system prompt leads it
    await ws.send(json.dumps({"type": "session.update", "session": {"tools": []}}))
    assert (await recv(ws))["type"] == "session.updated"
    note = {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "Note."}]}
    await ws.send(json.dumps({"type": "conversation.item.create", "item": note}))
    await until(ws, "conversation.item.done")
    await reply("four")
    assert engine.requests[-1] == [
        ("system", "Be terse."),
        ("system", "Note."),
        ("user", "four"),
        ("assistant", ""),
    ]
    assert len(engine.sessions) == opened


async def test_response_instructions_come_before_a_text_turn_as_before_a_spoken_one(served):
    """docs/protocol.md: response.instructions are a system turn just before the user's turn, text or
    spoken. With speech they were; with a text message they came after it (the reply's prompt was the
    user's turn, then the instructions), so the same request placed them by how the user spoke."""
    engine, ws = served
    await ws.send(json.dumps(user_message("Hello.")))
    await ws.send(json.dumps({"type": "response.create", "response": {"instructions": "In French."}}))
    assert (await until(ws, "response.done"))[-1]["response"]["status"] == "completed"
    assert engine.requests[-1] == "Hello." and engine.turn_instructions[-1] == "In French."
    # with no new input (a greeting) they are the turn the reply answers
    await ws.send(json.dumps({"type": "response.create", "response": {"instructions": "Greet."}}))
    assert (await until(ws, "response.done"))[-1]["response"]["status"] == "completed"
    assert engine.requests[-1][-2:] == [("system", "Greet."), ("assistant", "")]


def test_the_template_rules_import_without_torch_or_the_server():
    """The framework adapters use the template's tool rules without the server extra (aiortc, websockets)."""
    import subprocess
    import sys

    code = (
        "import sys, omni_rt.tools; "
        "sys.exit(any(m in sys.modules for m in ('torch', 'omni_rt.server', 'aiortc', 'websockets')))"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
