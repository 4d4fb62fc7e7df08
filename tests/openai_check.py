"""Server events checked against the official `openai` SDK's own models.

The SDK itself parses events without validating them (`construct_type_unchecked`): a field of the wrong
type or a status outside its literals passes there and breaks the client later. Here every event is
validated against the pydantic model the SDK declares for its `type`, so such a mismatch fails a test.
"""

from __future__ import annotations

import json
import typing

from openai.types.realtime import RealtimeServerEvent

# `RealtimeServerEvent` is Annotated[Union[...], PropertyInfo(discriminator="type")]: one model per type.
_MODELS: dict[str, type] = {}
for _model in typing.get_args(typing.get_args(RealtimeServerEvent)[0]):
    for _literal in typing.get_args(_model.model_fields["type"].annotation):
        _MODELS[_literal] = _model

# Events the SDK does not model that omni_rt sends all the same (documented in docs/protocol.md).
OMNI_RT_EVENTS = {"webrtc.answer"}


def validate(raw: str | bytes | dict) -> dict:
    """One server event as JSON → the dict, after the SDK's model for its type accepted it."""
    event = json.loads(raw) if isinstance(raw, str | bytes) else raw
    model = _MODELS.get(event["type"])
    if model is None:
        assert event["type"] in OMNI_RT_EVENTS, f"the SDK knows no event {event['type']!r}"
        return event
    model.model_validate(event)  # raises pydantic.ValidationError on any mismatch
    return event
