"""The realtime events on the wire: parsing client events, the shapes of server events, and a session
driven over the socket alone (no WebRTC), as an OpenAI Realtime client would drive it."""

import asyncio
import base64
import json

import numpy as np
import pytest

pytest.importorskip("websockets")

import websockets  # noqa: E402
from openai_check import validate  # noqa: E402
from server_fakes import FakeEngine, user_message  # noqa: E402

from omni_rt import wire  # noqa: E402
from omni_rt.server import protocol  # noqa: E402
from omni_rt.server.app import Server, ServerSettings  # noqa: E402
from omni_rt.server.peer import PeerSettings  # noqa: E402
from omni_rt.server.protocol import ProtocolError, parse_client_event  # noqa: E402

# -- parsing -----------------------------------------------------------------------------------------------


def test_parses_the_ga_client_events():
    ev = parse_client_event(
        json.dumps(
            {
                "type": "session.update",
                "event_id": "c1",
                "session": {
                    "type": "realtime",
                    "instructions": "Be brief.",
                    "output_modalities": ["audio"],
                    "audio": {"output": {"voice": "chelsie", "format": {"type": "audio/pcm"}}},
                    "tracing": "auto",  # fields omni_rt does not use are tolerated
                },
            }
        )
    )
    assert isinstance(ev, protocol.SessionUpdate)
    assert ev.event_id == "c1" and ev.session.audio.output.voice == "chelsie"
    pcm = {"type": "audio/pcm", "rate": 24000}
    beta = {"output_audio_format": "pcm16", "input_audio_format": "pcm16"}
    for session in (
        {"type": "realtime", "audio": {"input": {"format": pcm}, "output": {"format": pcm}}},
        beta,
    ):
        assert parse_client_event(json.dumps({"type": "session.update", "session": session}))
    item = parse_client_event(json.dumps(user_message("hello")))
    assert protocol.message_text(item.item) == "hello"
    assert isinstance(parse_client_event('{"type": "response.create"}'), protocol.ResponseCreate)
    assert isinstance(parse_client_event('{"type": "response.cancel"}'), protocol.ResponseCancel)
    assert parse_client_event(b'{"type": "webrtc.offer", "sdp": "v=0"}').sdp == "v=0"


def test_parses_speech_input_events_and_turn_detection():
    pcm = np.array([0, 1, -1, 32767, -32768], dtype=np.int16)
    append = parse_client_event(
        json.dumps(
            {
                "type": "input_audio_buffer.append",
                "audio": base64.b64encode(pcm.astype("<i2").tobytes()).decode(),
            }
        )
    )
    assert np.array_equal(append.pcm(), pcm)
    assert isinstance(
        parse_client_event('{"type": "input_audio_buffer.commit"}'), protocol.InputAudioBufferCommit
    )
    assert isinstance(
        parse_client_event('{"type": "input_audio_buffer.clear"}'), protocol.InputAudioBufferClear
    )
    truncate = parse_client_event(
        '{"type": "conversation.item.truncate", "item_id": "item_1", "content_index": 0, "audio_end_ms": 1500}'
    )
    assert (truncate.item_id, truncate.audio_end_ms) == ("item_1", 1500)

    def detection(session: dict):
        return protocol.turn_detection_of(
            parse_client_event(json.dumps({"type": "session.update", "session": session})).session
        )

    assert detection({"instructions": "x"}) == (False, None)  # not given: unchanged
    assert detection({"audio": {"input": {"turn_detection": None}}}) == (True, None)  # GA: off
    assert detection({"turn_detection": None}) == (True, None)  # beta, flat
    given, fields = detection(
        {"audio": {"input": {"turn_detection": {"type": "server_vad", "silence_duration_ms": 800}}}}
    )
    assert given and fields.silence_duration_ms == 800 and fields.threshold is None


@pytest.mark.parametrize(
    ("audio", "message"),
    [("not base64!", "base64"), (base64.b64encode(b"\x01\x02\x03").decode(), "even number")],
)
def test_malformed_append_audio_is_an_invalid_value(audio, message):
    event = parse_client_event(
        json.dumps({"type": "input_audio_buffer.append", "audio": audio, "event_id": "c4"})
    )
    with pytest.raises(ProtocolError, match=message) as err:
        event.pcm()
    assert (err.value.code, err.value.param, err.value.event_id, err.value.fatal) == (
        "invalid_value",
        "audio",
        "c4",
        False,
    )


@pytest.mark.parametrize(
    ("raw", "code", "fatal"),
    [
        ("", "invalid_json", False),
        ("{", "invalid_json", False),
        (b"\xff\xfe", "invalid_json", False),
        ("42", "invalid_event", False),
        # Nesting deep enough to exhaust Python's recursion limit, in a message of a few kB.
        pytest.param(
            '{"type": "session.update", "session": {"x": ' + "[" * 5000 + "]" * 5000 + "}}",
            "invalid_json",
            False,
            id="deep-nesting",
        ),
        ('{"type": 7}', "invalid_event", False),
        ('{"type": "response.explode"}', "unknown_event", False),
        ('{"type": "session.update"}', "invalid_value", False),
        ('{"type": "session.update", "session": {"output_modalities": []}}', "invalid_value", False),
        (
            '{"type": "conversation.item.create", "item": {"role": "user", "content": "hi"}}',
            "invalid_value",
            False,
        ),
        ('{"type": "webrtc.offer", "sdp": ""}', "invalid_value", False),
        # A lone surrogate is valid JSON but not text: the tokenizer raises TypeError on it.
        ('{"type": "session.update", "session": {"instructions": "a \\ud800 b"}}', "invalid_value", False),
        (
            '{"type": "conversation.item.create", "item": {"content": [{"type": "input_text", "text": "\\udcff"}]}}',
            "invalid_value",
            False,
        ),
        (
            '{"type": "session.update", "session": {"turn_detection": {"type": "semantic_vad", "eagerness": "now"}}}',
            "invalid_value",
            False,
        ),
        (
            '{"type": "session.update", "session": {"turn_detection": {"threshold": 1.5}}}',
            "invalid_value",
            False,
        ),
        (
            '{"type": "session.update", "session": {"audio": {"input": {"format": {"rate": 16000}}}}}',
            "invalid_value",
            False,
        ),
        # Formats and session kinds omni_rt does not serve are refused, not served as something else.
        (
            '{"type": "session.update", "session": {"audio": {"output": {"format": {"type": "audio/pcmu"}}}}}',
            "invalid_value",
            False,
        ),
        (
            '{"type": "session.update", "session": {"output_audio_format": "g711_ulaw"}}',
            "invalid_value",
            False,
        ),
        (
            '{"type": "session.update", "session": {"input_audio_format": "g711_alaw"}}',
            "invalid_value",
            False,
        ),
        ('{"type": "session.update", "session": {"type": "transcription"}}', "invalid_value", False),
        (
            '{"type": "response.create", "response": {"audio": {"output": {"format": {"type": "audio/pcma"}}}}}',
            "invalid_value",
            False,
        ),
        (
            '{"type": "conversation.item.truncate", "item_id": "i", "audio_end_ms": -1}',
            "invalid_value",
            False,
        ),
        (
            json.dumps({"type": "input_audio_buffer.append", "audio": "A" * (protocol.MAX_APPEND_CHARS + 4)}),
            "invalid_value",
            False,
        ),
    ],
)
def test_bad_client_events_raise_protocol_errors(raw, code, fatal):
    with pytest.raises(ProtocolError) as err:
        parse_client_event(raw)
    assert err.value.code == code
    assert err.value.fatal is fatal


@pytest.mark.parametrize(
    ("event", "param"),
    [
        ({"type": "session.update", "session": {"max_output_tokens": 0}}, "session.max_output_tokens"),
        ({"type": "session.update", "session": {"tool_choice": {"type": "mcp"}}}, "session.tool_choice"),
        ({"type": "session.update", "session": {"tool_choice": "any"}}, "session.tool_choice"),
        (
            {"type": "response.create", "response": {"max_output_tokens": "lots"}},
            "response.max_output_tokens",
        ),
        ({"type": "session.update", "session": {"tools": [{"type": "function"}]}}, "session.tools.0.name"),
        ({"type": "input_audio_buffer.append"}, "audio"),
    ],
)
def test_the_param_of_an_error_names_the_clients_field(event, param):
    """`param` once carried pydantic's names for union members (`session.max_output_tokens.constrained-int`)."""
    with pytest.raises(ProtocolError) as err:
        parse_client_event(json.dumps(event))
    assert err.value.param == param


def test_size_limit_counts_bytes():
    text = json.dumps(user_message("é" * 600))  # 1,200 bytes of text in 600 characters
    with pytest.raises(ProtocolError, match="exceeds") as err:
        parse_client_event(text, max_bytes=1000)
    assert err.value.code == "message_too_large" and not err.value.fatal  # this event fails, alone


def test_error_event_shape():
    ev = protocol.error(ProtocolError("no_input", "nothing to say", param="item", event_id="c9"))
    assert ev["type"] == "error" and ev["event_id"].startswith("event_")
    assert ev["error"] == {
        "type": "invalid_request_error",
        "code": "no_input",
        "message": "nothing to say",
        "param": "item",
        "event_id": "c9",
    }


def test_audio_delta_is_base64_little_endian_pcm16():
    pcm = np.array([0, 1, -1, 32767, -32768], dtype=np.int16)
    ev = wire.audio_delta("resp_1", "item_1", pcm)
    raw = base64.b64decode(ev["delta"])
    assert raw == b"\x00\x00\x01\x00\xff\xff\xff\x7f\x00\x80"
    assert ev["response_id"] == "resp_1" and ev["item_id"] == "item_1"


def test_metrics_keep_only_numbers():
    from omni_rt.events import Metrics

    m = wire.metrics_dict(Metrics(ttft_ms=12.5, ttfa_ms=40.0))
    assert m["ttft_ms"] == 12.5 and m["ttfa_ms"] == 40.0 and m["total_ms"] is None
    assert wire.metrics_dict(None) == {}


# -- a session over the socket -------------------------------------------------------------------------------


async def recv(ws) -> dict:
    return validate(await asyncio.wait_for(ws.recv(), 5))  # every event, as the SDK's model has it


async def until(ws, type_: str) -> list[dict]:
    events = [await recv(ws)]
    while events[-1]["type"] != type_:
        events.append(await recv(ws))
    return events


@pytest.fixture
async def served():
    engine = FakeEngine(step_s=0.0, reply="fine thanks")
    settings = ServerSettings(port=0, peer=PeerSettings(model="tiny", max_output_tokens=64))
    async with Server(engine, settings) as server:
        async with websockets.connect(f"ws://127.0.0.1:{server.port}/ws") as ws:
            yield engine, server, ws


async def test_session_created_then_updated(served):
    engine, _, ws = served
    created = await recv(ws)
    assert created["type"] == "session.created"
    session = created["session"]
    assert session["object"] == "realtime.session" and session["model"] == "tiny"
    assert session["audio"]["output"] == {"format": {"type": "audio/pcm", "rate": 24000}, "voice": "ethan"}

    await ws.send(
        json.dumps(
            {
                "type": "session.update",
                "session": {"instructions": "Speak softly.", "audio": {"output": {"voice": "chelsie"}}},
            }
        )
    )
    updated = await recv(ws)
    assert updated["type"] == "session.updated"
    assert updated["session"]["audio"]["output"]["voice"] == "chelsie"
    assert updated["session"]["instructions"] == "Speak softly."
    # The engine now serves a session with that voice and system prompt; the old one is closed.
    assert (engine.sessions[-1].voice, engine.sessions[-1].instructions) == ("chelsie", "Speak softly.")
    assert engine.open_sessions == 1

    # A bad voice is refused as a whole and leaves the session (and its conversation) as it was.
    opened = len(engine.sessions)
    await ws.send(
        json.dumps(
            {
                "type": "session.update",
                "session": {"output_modalities": ["text"], "audio": {"output": {"voice": "x"}}},
            }
        )
    )
    error = await recv(ws)
    assert error["type"] == "error" and error["error"]["param"] == "session.audio.output.voice"
    assert len(engine.sessions) == opened and engine.open_sessions == 1
    await ws.send(json.dumps({"type": "session.update", "session": {}}))
    unchanged = (await recv(ws))["session"]
    assert unchanged["output_modalities"] == ["audio"] and unchanged["audio"]["output"]["voice"] == "chelsie"


async def test_a_whole_turn_in_order(served):
    engine, _, ws = served
    await recv(ws)
    await ws.send(json.dumps(user_message("how are you?")))
    added = await recv(ws)
    assert added["type"] == "conversation.item.added"
    assert added["item"]["role"] == "user" and added["item"]["content"][0]["text"] == "how are you?"
    assert (await recv(ws))["type"] == "conversation.item.done"

    await ws.send(json.dumps({"type": "response.create", "response": {"max_output_tokens": 1}}))
    events = await until(ws, "response.done")
    types = [e["type"] for e in events]
    assert types[0] == "response.created"
    assert types[-1] == "response.done"
    assert types.index("response.output_audio.delta") < types.index("response.output_audio.done")
    # max_output_tokens reaches the session (clamped to the server's limit when larger).
    assert [e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta"] == ["fine"]
    assert "response.output_text.delta" not in types  # audio modality: the transcript carries the text
    rid = events[0]["response"]["id"]
    assert all(e.get("response_id", rid) == rid for e in events[1:-1])
    done = events[-1]["response"]
    # The one token allowed was used up: the reply was stopped by the limit, not by the model.
    assert done["id"] == rid and done["status"] == "incomplete"
    assert done["status_details"] == {"type": "incomplete", "reason": "max_output_tokens"}
    assert done["output"][0]["role"] == "assistant" and done["output"][0]["status"] == "incomplete"
    assert done["output"][0]["content"][0]["transcript"] == "fine"
    assert done["usage"]["output_tokens"] == 1
    assert engine.requests == ["how are you?"]


async def test_text_only_response_sends_no_audio(served):
    _, _, ws = served
    await recv(ws)
    await ws.send(json.dumps(user_message("hi")))
    await ws.send(json.dumps({"type": "response.create", "response": {"output_modalities": ["text"]}}))
    events = await until(ws, "response.done")
    types = [e["type"] for e in events]
    assert (
        "response.output_audio.delta" not in types and "response.output_audio_transcript.delta" not in types
    )
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "fine thanks"
    assert "response.output_text.done" in types


async def test_one_response_at_a_time_and_cancel(served):
    engine, _, ws = served
    engine.step_s = 0.05
    engine.reply = " ".join(["word"] * 100)
    await recv(ws)
    await ws.send(json.dumps(user_message("go on")))
    await ws.send(json.dumps({"type": "response.create"}))
    await until(ws, "response.created")
    await ws.send(json.dumps(user_message("and another")))
    await ws.send(json.dumps({"type": "response.create", "event_id": "second"}))
    events = await until(ws, "error")
    assert events[-1]["error"]["code"] == "conversation_already_has_active_response"
    assert events[-1]["error"]["event_id"] == "second"
    # a session update while a reply runs is the next reply's (OpenAI's server takes it; the pipecat and
    # LiveKit OpenAI services send one mid-reply): refused before, now it changes nothing running
    opened = len(engine.sessions)
    await ws.send(
        json.dumps({"type": "session.update", "session": {"instructions": "new", "voice": "chelsie"}})
    )
    updated = (await until(ws, "session.updated"))[-1]["session"]
    assert updated["instructions"] == "new" and updated["audio"]["output"]["voice"] == "chelsie"
    assert engine.voices[-1] == "ethan"

    await ws.send(json.dumps({"type": "response.cancel"}))
    done = (await until(ws, "response.done"))[-1]["response"]
    assert done["status"] == "cancelled"
    assert done["status_details"]["type"] == "cancelled"
    # The pending user message is answered by the next response.
    engine.step_s, engine.reply = 0.0, "ok"
    await ws.send(json.dumps({"type": "response.create"}))
    assert (await until(ws, "response.done"))[-1]["response"]["status"] == "completed"
    assert engine.requests[-1] == "and another"
    # the same Session; the next reply carries the new instructions as its system turn, in the new voice
    assert len(engine.sessions) == opened
    assert engine.turn_instructions[-1] == "new" and engine.voices[-1] == "chelsie"


async def test_session_reports_and_updates_turn_detection(served):
    _, server, ws = served
    created = (await recv(ws))["session"]
    assert created["audio"]["input"] == {
        "format": {"type": "audio/pcm", "rate": 24000},
        "turn_detection": {
            "type": "server_vad",
            "threshold": 0.5,
            "prefix_padding_ms": 300,
            "silence_duration_ms": 500,
            "create_response": True,
            "interrupt_response": True,
            "speculative_response": True,
        },
    }
    update = {
        "turn_detection": {"type": "server_vad", "silence_duration_ms": 789, "interrupt_response": False}
    }
    await ws.send(json.dumps({"type": "session.update", "session": {"audio": {"input": update}}}))
    detection = (await recv(ws))["session"]["audio"]["input"]["turn_detection"]
    # missing fields take the defaults; times are kept as given (the detector rounds up to its frames)
    assert detection["silence_duration_ms"] == 789 and detection["prefix_padding_ms"] == 300
    assert detection["interrupt_response"] is False and detection["create_response"] is True
    (peer,) = server.peers
    assert peer.input.segmenter.vad.cfg.silence_duration_ms == 789
    semantic = {"turn_detection": {"type": "semantic_vad", "eagerness": "high"}}
    await ws.send(json.dumps({"type": "session.update", "session": {"audio": {"input": semantic}}}))
    detection = (await recv(ws))["session"]["audio"]["input"]["turn_detection"]
    assert detection == {
        "type": "semantic_vad",
        "eagerness": "high",
        "create_response": True,
        "interrupt_response": True,
        "speculative_response": True,
    }
    assert type(peer.input.segmenter.vad).__name__ == "SemanticVad"
    await ws.send(json.dumps({"type": "session.update", "session": {"turn_detection": None}}))
    assert (await recv(ws))["session"]["audio"]["input"]["turn_detection"] is None
    assert not peer.input.segmenter.detect


async def test_a_failing_stage_fails_the_response_not_the_connection(served):
    engine, _, ws = served
    engine.fail_after = 1
    await recv(ws)
    await ws.send(json.dumps(user_message("hi")))
    await ws.send(json.dumps({"type": "response.create"}))
    events = await until(ws, "response.done")
    error = next(e for e in events if e["type"] == "error")
    assert error["error"]["code"] == "StageError" and "simulated" in error["error"]["message"]
    assert events[-1]["response"]["status"] == "failed"
    engine.fail_after = None
    await ws.send(json.dumps(user_message("again")))
    await ws.send(json.dumps({"type": "response.create"}))
    assert (await until(ws, "response.done"))[-1]["response"]["status"] == "completed"


async def test_a_cancel_that_fails_is_an_error_not_a_lost_connection(served, monkeypatch):
    from server_fakes import FakeSession

    from omni_rt.errors import StageError

    async def stuck_cancel(self):
        self._cancel.set()  # it does stop in the end, but the session gave up waiting first
        raise StageError("the pipeline did not stop the response within 60 s")

    monkeypatch.setattr(FakeSession, "cancel", stuck_cancel)
    engine, _, ws = served
    engine.step_s, engine.reply = 0.05, " ".join(["word"] * 100)
    await recv(ws)
    await ws.send(json.dumps(user_message("hi")))
    await ws.send(json.dumps({"type": "response.create"}))
    await until(ws, "response.created")
    await ws.send(json.dumps({"type": "response.cancel", "event_id": "c1"}))
    events = await until(ws, "response.done")
    error = next(e for e in events if e["type"] == "error")["error"]
    assert (error["code"], error["event_id"]) == ("StageError", "c1")
    engine.step_s, engine.reply = 0.0, "ok"
    await ws.send(json.dumps(user_message("again")))
    await ws.send(json.dumps({"type": "response.create"}))
    assert (await until(ws, "response.done"))[-1]["response"]["status"] == "completed"


def test_ice_server_urls():
    from omni_rt.server.webrtc import ice_server

    stun = ice_server("stun:stun.example:3478")
    assert (stun.urls, stun.username, stun.credential) == ("stun:stun.example:3478", None, None)
    turn = ice_server("turn:al%40ice:p%3Ass@relay.example:3478?transport=udp")
    assert turn.urls == "turn:relay.example:3478?transport=udp"
    assert (turn.username, turn.credential) == ("al@ice", "p:ss")
    with pytest.raises(ValueError):
        ice_server("http://example.com")


async def test_a_repeated_cancel_is_answered(served):
    """Issue #13, defect 8: a second response.cancel while the first is still stopping the reply
    gets `response_cancel_not_active` (it once got no answer at all)."""
    engine, _, ws = served
    engine.step_s = 0.5  # the reply stops at its next word: the second cancel comes while it stops
    await recv(ws)
    await ws.send(json.dumps(user_message("talk")))
    await ws.send(json.dumps({"type": "response.create"}))
    await until(ws, "response.created")
    await ws.send(json.dumps({"type": "response.cancel", "event_id": "c1"}))
    await ws.send(json.dumps({"type": "response.cancel", "event_id": "c2"}))
    events = await until(ws, "response.done")
    errors = [e["error"] for e in events if e["type"] == "error"]
    assert [(e["code"], e["event_id"]) for e in errors] == [("response_cancel_not_active", "c2")]
    assert events[-1]["response"]["status"] == "cancelled"


async def test_openai_defaults_that_clients_send_are_accepted(served):
    """livekit's defaults (semantic_vad, voice marin) once made its whole session.update refused."""
    _, _, ws = served
    await recv(ws)
    session = {
        "type": "realtime",
        "audio": {
            "input": {"turn_detection": {"type": "semantic_vad", "eagerness": "auto"}},
            "output": {"voice": "marin"},
        },
    }
    await ws.send(json.dumps({"type": "session.update", "session": session}))
    updated = (await recv(ws))["session"]
    assert updated["audio"]["output"]["voice"] == "chelsie"  # by the voice table
    detection = updated["audio"]["input"]["turn_detection"]
    assert (detection["type"], detection["eagerness"]) == ("semantic_vad", "auto")  # served as asked


async def test_a_per_response_voice_is_the_voice_the_reply_is_spoken_in(served):
    """`response.audio.output.voice` was echoed in `response.created` but the reply was spoken in the
    session's voice; the next reply without one is the session's again."""
    engine, _, ws = served
    await recv(ws)
    await ws.send(json.dumps(user_message("hi")))
    await ws.send(
        json.dumps({"type": "response.create", "response": {"audio": {"output": {"voice": "alloy"}}}})
    )
    events = await until(ws, "response.done")
    created = next(e for e in events if e["type"] == "response.created")
    assert created["response"]["audio"]["output"]["voice"] == "chelsie"  # alloy, by the voice table
    await ws.send(json.dumps({"type": "response.create"}))
    await until(ws, "response.done")
    assert engine.voices == ["chelsie", "ethan"]


async def test_content_the_model_cannot_take_is_refused_not_dropped(served):
    """A user message of text and audio (or an image) once became its text alone, the rest dropped
    without a word; such parts are now refused, with nothing added to the conversation."""
    engine, _, ws = served
    await recv(ws)
    audio = base64.b64encode(np.zeros(2400, "<i2").tobytes()).decode()
    for part in ({"type": "input_audio", "audio": audio}, {"type": "input_image", "image_url": "data:,"}):
        item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}, part]}
        await ws.send(json.dumps({"type": "conversation.item.create", "event_id": "c1", "item": item}))
        error = (await recv(ws))["error"]
        assert (error["code"], error["param"], error["event_id"]) == (
            "unsupported_value", "item.content.1.type", "c1",
        )  # fmt: skip
    await ws.send(json.dumps(user_message("only this")))
    added = await recv(ws)
    assert added["type"] == "conversation.item.added" and added["previous_item_id"] is None


async def test_the_reply_item_is_in_the_conversation_from_its_announcement(served):
    """The assistant item a reply announced (conversation.item.added) was unknown until the reply ended:
    it could not be retrieved, a `previous_item_id` naming it was refused, and a user item created
    meanwhile was echoed as following the item before it."""
    engine, _, ws = served
    engine.step_s, engine.reply = 0.05, " ".join(["word"] * 40)
    await recv(ws)
    await ws.send(json.dumps(user_message("hi")))
    await ws.send(json.dumps({"type": "response.create"}))
    added = [
        e for e in await until(ws, "response.content_part.added") if e["type"] == "conversation.item.added"
    ][-1]
    assert added["item"]["role"] == "assistant"
    assistant = added["item"]["id"]
    await ws.send(json.dumps({"type": "conversation.item.retrieve", "item_id": assistant}))
    await ws.send(json.dumps({**user_message("and then?"), "previous_item_id": assistant}))
    events = await until(ws, "conversation.item.done")
    retrieved = next(e for e in events if e["type"] == "conversation.item.retrieved")
    assert retrieved["item"]["id"] == assistant and retrieved["item"]["status"] == "in_progress"
    user = events[-1]
    assert user["item"]["role"] == "user" and user["previous_item_id"] == assistant
    done = await until(ws, "response.done")
    # The reply's own done events keep its place; the conversation's last item is still the user's.
    assert (
        next(e for e in done if e["type"] == "conversation.item.done")["previous_item_id"]
        == added["previous_item_id"]
    )
    await ws.send(json.dumps({"type": "conversation.item.retrieve", "item_id": assistant}))
    assert (await recv(ws))["item"] == done[-1]["response"]["output"][0]  # as it ended
    await ws.send(json.dumps({**user_message("more"), "previous_item_id": user["item"]["id"]}))
    assert (await recv(ws))["previous_item_id"] == user["item"]["id"]


async def test_root_is_the_place_of_the_first_item(served):
    """`previous_item_id: "root"` is OpenAI's beginning of the conversation; livekit's agents send it
    with the first item of a chat context they sync, which was refused even into an empty conversation."""
    _, _, ws = served
    await recv(ws)
    await ws.send(json.dumps({**user_message("first"), "previous_item_id": "root"}))
    added = await recv(ws)
    assert added["type"] == "conversation.item.added" and added["previous_item_id"] is None
    await recv(ws)
    await ws.send(json.dumps({**user_message("second"), "previous_item_id": "root"}))
    error = (await recv(ws))["error"]  # items join at the end only (docs/protocol.md, differences)
    assert (error["code"], error["param"]) == ("invalid_value", "previous_item_id")
