"""Event models: Realtime GA names, validation, wire form (base64 PCM16), discriminated parsing."""

import base64

import numpy as np
import pytest
from pydantic import TypeAdapter, ValidationError

from omni_rt.errors import InvalidRequestError, StageError
from omni_rt.events import (
    AnyEvent,
    ErrorEvent,
    InputAudioBufferCleared,
    InputAudioBufferCommitted,
    InputAudioBufferSpeechStarted,
    InputAudioBufferSpeechStopped,
    Metrics,
    ResponseCreated,
    ResponseDone,
    ResponseOutputAudioDelta,
    ResponseOutputAudioDone,
    ResponseOutputAudioTranscriptDelta,
    ResponseOutputTextDelta,
    Usage,
)


def test_type_names_are_the_realtime_ga_names():
    rid = "resp_1"
    pcm = np.zeros(4, np.int16)
    names = [
        ResponseCreated(response_id=rid).type,
        ResponseOutputTextDelta(response_id=rid, delta="a", token_ids=[1]).type,
        ResponseOutputAudioTranscriptDelta(response_id=rid, delta="a").type,
        ResponseOutputAudioDelta(
            response_id=rid, pcm=pcm, sample_rate=24000, frame_index=0, num_frames=1
        ).type,
        ResponseOutputAudioDone(response_id=rid).type,
        ResponseDone(response_id=rid, status="completed").type,
        ErrorEvent.from_exception(ValueError("x")).type,
    ]
    assert names == [
        "response.created",
        "response.output_text.delta",
        "response.output_audio_transcript.delta",
        "response.output_audio.delta",
        "response.output_audio.done",
        "response.done",
        "error",
    ]


def test_event_ids_are_unique():
    a, b = ResponseCreated(response_id="r"), ResponseCreated(response_id="r")
    assert a.event_id != b.event_id


def test_audio_delta_wire_form_is_base64_pcm16_le():
    pcm = np.array([0, 1, -1, 32767, -32768], dtype=np.int16)
    ev = ResponseOutputAudioDelta(response_id="r", pcm=pcm, sample_rate=48000, frame_index=3, num_frames=2)
    wire = ev.to_wire(item_id="item_1")
    assert wire["type"] == "response.output_audio.delta" and wire["response_id"] == "r"
    assert (wire["item_id"], wire["output_index"], wire["content_index"]) == ("item_1", 0, 0)
    raw = base64.b64decode(wire["delta"])
    np.testing.assert_array_equal(np.frombuffer(raw, dtype="<i2"), pcm)
    assert ev.b64() == wire["delta"]
    assert ev.duration_s == pytest.approx(5 / 48000)


@pytest.mark.parametrize(
    "bad", [np.zeros(4, np.float32), np.zeros((2, 2), np.int16), [0, 1, 2]], ids=["float", "2d", "list"]
)
def test_audio_delta_rejects_non_int16_mono(bad):
    with pytest.raises(ValidationError):
        ResponseOutputAudioDelta(response_id="r", pcm=bad, sample_rate=24000, frame_index=0, num_frames=1)


def test_done_carries_status_usage_metrics_and_error():
    err = ErrorEvent.from_exception(StageError("talker step failed"), "r").error
    done = ResponseDone(
        response_id="r",
        status="failed",
        usage=Usage(input_tokens=5, output_tokens=2, audio_frames=3),
        metrics=Metrics(ttft_ms=1.5, ttfa_ms=2.5, audio_seconds=0.24, rtf=0.5),
        error=err,
    )
    wire = done.to_wire()
    assert wire["event_id"] == done.event_id and wire["response"]["status"] == "failed"
    assert wire["response"]["usage"]["output_tokens"] == 2 and wire["response"]["usage"]["input_tokens"] == 5
    assert wire["response"]["usage"]["audio_frames"] == 3
    assert wire["response"]["metrics"]["ttfa_ms"] == 2.5
    assert wire["response"]["status_details"]["error"]["code"] == "StageError"
    with pytest.raises(ValidationError):
        ResponseDone(response_id="r", status="exploded")


def test_error_kinds():
    bad = ErrorEvent.from_exception(InvalidRequestError("empty input"), "r")
    assert bad.error.type == "invalid_request_error" and bad.error.code == "InvalidRequestError"
    wire = bad.to_wire()
    assert wire == {
        "type": "error",
        "event_id": bad.event_id,
        "error": {**bad.error.model_dump(), "param": None, "event_id": None},
    }
    crash = ErrorEvent.from_exception(RuntimeError("boom"))
    assert crash.error.type == "server_error" and crash.error.message == "boom"


def test_events_parse_back_by_type():
    adapter = TypeAdapter(AnyEvent)
    ev = ResponseOutputTextDelta(response_id="r", delta="hé", token_ids=[5, 6])
    back = adapter.validate_python(ev.model_dump())
    assert isinstance(back, ResponseOutputTextDelta) and back == ev
    done = adapter.validate_python(ResponseDone(response_id="r", status="cancelled").model_dump())
    assert isinstance(done, ResponseDone) and done.status == "cancelled"


def test_events_are_immutable():
    ev = ResponseCreated(response_id="r")
    with pytest.raises(ValidationError):
        ev.response_id = "other"


def test_input_audio_buffer_events_on_the_wire():
    started = InputAudioBufferSpeechStarted(audio_start_ms=700, item_id="item_1")
    wire = started.to_wire()
    assert wire == {
        "type": "input_audio_buffer.speech_started",
        "event_id": started.event_id,
        "audio_start_ms": 700,
        "item_id": "item_1",
    }
    stopped = InputAudioBufferSpeechStopped(audio_end_ms=2500, item_id="item_1").to_wire()
    assert (stopped["type"], stopped["audio_end_ms"]) == ("input_audio_buffer.speech_stopped", 2500)
    committed = InputAudioBufferCommitted(item_id="item_1").to_wire()
    assert committed["type"] == "input_audio_buffer.committed" and committed["previous_item_id"] is None
    assert InputAudioBufferCleared().to_wire()["type"] == "input_audio_buffer.cleared"
    adapter = TypeAdapter(AnyEvent)
    assert adapter.validate_python(started.model_dump()) == started
    with pytest.raises(ValidationError):
        InputAudioBufferSpeechStarted(audio_start_ms=700)  # the item id is part of the event
