"""One reply on the wire: a Session's events in, the GA Realtime event flow of a response out.

Every reply goes out in the order OpenAI's Realtime API sends it, which clients rely on (livekit-agents
keys every delta by the item that `response.output_item.added` announced):

    response.created
    response.output_item.added → conversation.item.added → response.content_part.added   (first delta)
    ...deltas...
    response.output_audio.done, response.output_audio_transcript.done / response.output_text.done
    response.content_part.done → response.output_item.done → conversation.item.done
    response.done

The item is announced at the first delta (or at the end of a reply that produced nothing but completed)
and always closed before `response.done`, with the same ids throughout. A reply cut short keeps its
item as `incomplete` (the item schema has no `cancelled`); the response says why in `status_details`.
Out-of-band replies (`conversation: "none"`) send no `conversation.item.*`: they are not in the
conversation. Nothing here awaits: `replies.py` drives it and owns the audio path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from omni_rt import wire
from omni_rt.server import protocol
from omni_rt.server.turns import SpokenTurnClock
from omni_rt.tools import BadToolCall, ToolCallParser

CancelReason = Literal["client_cancelled", "turn_detected"]


@dataclass
class Response:
    item_id: str
    modalities: list[str]
    max_tokens: int
    voice: str
    sample_rate: int
    send: Callable[[dict[str, Any]], None]
    metadata: dict[str, str] | None = None
    in_conversation: bool = True  # False: out-of-band (conversation "none")
    # Puts an item the reply announces in the conversation (`Conversation.place`): the id before it.
    place: Callable[[dict[str, Any]], str | None] = lambda item: None
    asked_max_tokens: int | str = "inf"  # as the request said it, echoed
    task: Any = None  # the asyncio.Task that runs it
    id: str | None = None  # the session's response id, once it says response.created
    cancelled: bool = False
    reason: CancelReason = "client_cancelled"
    transcript: list[str] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    audio_ms: float = 0.0  # audio the session made for it
    played_ms: float | None = None  # what the client played (conversation.item.truncate, or the track)
    item: dict[str, Any] | None = None  # the closed assistant message, once done
    tools: ToolCallParser | None = None  # the session's tools: <tool_call>s become function calls
    calls: list[dict[str, Any]] = field(default_factory=list)  # function_call items made
    failed: str | None = None  # a malformed tool call: the response fails (closed)
    refused: bool = False  # the Session failed it: its turn is not in the context (Session._commit)
    spoken: SpokenTurnClock | None = None  # the spoken turn it answers: end_of_speech / voice_to_voice
    _item_open: bool = False
    _message_previous: str | None = None
    _audio_done: bool = False
    _ended: bool = False

    @property
    def audio(self) -> bool:
        return "audio" in self.modalities

    def echo(self) -> dict[str, Any]:
        return wire.response_echo(
            conversation=self.in_conversation,
            modalities=self.modalities,
            max_output_tokens=self.asked_max_tokens,
            voice=self.voice,
            sample_rate=self.sample_rate,
            metadata=self.metadata,
        )

    # -- the flow ---------------------------------------------------------------------------------------

    def created(self, response_id: str) -> None:
        self.id = response_id
        self.send(wire.response_created(wire.response_object(response_id, "in_progress", echo=self.echo())))

    @property
    def speaking(self) -> bool:
        """False once a tool call began: from there nothing of the reply is said or shown."""
        return self.tools is None or not self.tools.calling

    def text_delta(self, delta: str, token_ids: list[int] | None = None) -> None:
        if self.tools is not None:
            delta, calls = self.tools.feed(delta, token_ids or [])
            for call in calls:
                self._call(call)
            if not delta:
                return
        self.text.append(delta)
        if "text" in self.modalities and delta:  # a token may end mid-character: no text yet
            self._open_item()
            self.send(wire.text_delta(self.id, self.item_id, delta))

    def transcript_delta(self, delta: str) -> None:
        if not self.speaking:
            return
        self.transcript.append(delta)
        if self.audio and delta:
            self._open_item()
            self.send(wire.transcript_delta(self.id, self.item_id, delta))

    def audio_delta(self, pcm: Any) -> None:
        """Audio as events, for a client with no track to play (in deltas of at most 500 ms each)."""
        self._open_item()
        self.send(wire.audio_delta(self.id, self.item_id, pcm))

    def audio_started(self) -> None:
        """Audio goes to the track: the item is announced before its first frame is played."""
        self._open_item()

    def audio_done(self) -> None:
        if self.audio and self._item_open and not self._audio_done:
            self._audio_done = True
            self.send(wire.audio_done(self.id, self.item_id))

    def done(self, ev: Any) -> None:
        """The session's response.done: close what is open, then the response, with its outcome."""
        if self.tools is not None:
            for bad in self.tools.end():  # a call left open by the model, not one cut by a cancel
                if ev.status != "cancelled":
                    self._call(bad)
        self.refused = ev.status == "failed"
        status, details = self._outcome(ev)
        if status == "completed" and not self.calls:
            self._open_item()  # an empty reply is still the assistant's turn
        output = self._close_item("completed" if status == "completed" else "incomplete") + self.calls
        self._ended = True
        self.send(
            wire.response_done(
                wire.response_object(
                    self.id,
                    status,
                    output,
                    status_details=details,
                    usage=wire.usage_object(getattr(ev, "usage", None)),
                    metrics=wire.metrics_dict(getattr(ev, "metrics", None))
                    | (self.spoken.metrics() if self.spoken is not None else {}),
                    echo=self.echo(),
                )
            )
        )

    def broken(self) -> None:
        """The session's stream ended without response.done (it promises one): the client gets one."""
        if self._ended or self.id is None:
            return
        status = "cancelled" if self.cancelled else "failed"
        details = self._details(status, None)
        output = self._close_item("incomplete") + self.calls
        self._ended = True
        self.send(
            wire.response_done(
                wire.response_object(self.id, status, output, status_details=details, echo=self.echo())
            )
        )

    # -- internals --------------------------------------------------------------------------------------

    def _open_item(self) -> None:
        if self._item_open or self.id is None:
            return
        self._item_open = True
        item = wire.assistant_item(self.item_id, "in_progress", self.audio, None)
        self.send(wire.output_item("added", self.id, item))
        if self.in_conversation:
            self._message_previous = self.place(item)
            self.send(wire.conversation_item_added(item, self._message_previous))
        self.send(wire.content_part("added", self.id, self.item_id, self.audio, ""))

    def _call(self, call: Any) -> None:
        """A tool call the reply made: a function_call item, announced and closed at once (its
        arguments are whole only at `</tool_call>`); a malformed one is an error and fails the reply."""
        if isinstance(call, BadToolCall):
            self.failed = call.message
            self.send(
                protocol.error(protocol.ProtocolError("invalid_tool_call", call.message, type="server_error"))
            )
            return
        index = int(self._item_open or self.item is not None) + len(self.calls)
        item_id, call_id = wire.new_id("item"), wire.new_id("call")
        item = wire.function_call_item(item_id, call_id, call.name, call.arguments, "in_progress")
        self.send(wire.output_item("added", self.id, {**item, "arguments": ""}, index))
        previous = None
        if self.in_conversation:
            previous = self.place({**item, "arguments": ""})
            self.send(wire.conversation_item_added({**item, "arguments": ""}, previous))
        self.send(wire.function_call_arguments("delta", self.id, item, index))
        self.send(wire.function_call_arguments("done", self.id, item, index))
        done = {**item, "status": "completed"}
        self.send(wire.output_item("done", self.id, done, index))
        if self.in_conversation:
            self.place(done)
            self.send(wire.conversation_item_done(done, previous))
        self.calls.append(done)

    def _close_item(self, status: str) -> list[dict[str, Any]]:
        """Close the item (if it was announced): the done events in order; returns the response output."""
        if not self._item_open:
            return []
        self.audio_done()
        text = self.final_text()
        if self.audio:
            self.send(wire.transcript_done(self.id, self.item_id, text))
        if "text" in self.modalities:
            self.send(wire.text_done(self.id, self.item_id, "".join(self.text)))
        self.send(wire.content_part("done", self.id, self.item_id, self.audio, text))
        item = wire.assistant_item(self.item_id, status, self.audio, text)
        self.send(wire.output_item("done", self.id, item))
        if self.in_conversation:
            self.place(item)
            self.send(wire.conversation_item_done(item, self._message_previous))
        self._item_open = False
        self.item = item
        return [item]

    def final_text(self) -> str:
        return "".join(self.transcript if self.audio else self.text) or "".join(self.transcript or self.text)

    def _outcome(self, ev: Any) -> tuple[str, dict[str, Any] | None]:
        status = ev.status
        error = getattr(ev, "error", None)
        if self.failed is not None and status == "completed":
            return "failed", {
                "type": "failed",
                "error": {"type": "server_error", "code": "invalid_tool_call"},
            }
        if status == "completed" and ev.usage is not None and ev.usage.output_tokens >= self.max_tokens:
            status = "incomplete"  # stopped by the token limit, not by the model
        return status, self._details(status, error)

    def _details(self, status: str, error: Any) -> dict[str, Any] | None:
        if status == "cancelled":
            return {"type": "cancelled", "reason": self.reason}
        if status == "incomplete":
            return {"type": "incomplete", "reason": "max_output_tokens"}
        if status == "failed":
            info = (
                error.model_dump() if error is not None else {"type": "server_error", "code": "server_error"}
            )
            return {"type": "failed", "error": info}
        return None
