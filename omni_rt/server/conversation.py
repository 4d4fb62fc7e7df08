"""One connection's conversation as the client sees it: its items, and the input not yet answered.

The model's context is the Session's (its KV cache); this is the client's view of it, by item id:
user, system and assistant messages, function calls and their outputs, spoken turns. Input added
since the last response waits here until the next one reads it (`take`); until then it can be
deleted. What a response has read cannot be: the Session's context is not rewritten. Items join at
the end only. The latest items are kept for `conversation.item.retrieve`.

A reply that fails read nothing into the context (the Session does not record a failed turn), so its
input waits again (`refused`), as OpenAI keeps a failed response's items: the next response answers it,
or the client deletes it. Input that fails twice in a row is what fails (a turn too long for the
context, ...): the server deletes it then (`conversation.item.deleted`), or it would fail every reply
after it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from omni_rt import wire
from omni_rt.server import protocol
from omni_rt.server.protocol import ProtocolError

KEPT_ITEMS = 512  # items remembered for conversation.item.retrieve / delete


class Conversation:
    def __init__(self, send: Callable[[dict[str, Any]], None], max_text_chars: int) -> None:
        self._send = send
        self.max_text_chars = max_text_chars
        self.last_item_id: str | None = None
        self._items: OrderedDict[str, dict[str, Any]] = OrderedDict()
        # Input since the last response, by item id: (role, text) turns, committed speech (16 kHz).
        self._text: dict[str, tuple[str, str]] = {}
        self._speech: dict[str, np.ndarray] = {}
        self._clips: dict[str, Any] = {}  # a spoken item's encoding made while it was spoken, if any
        # What the last response read (text, speech, clips), until it ends; the items a failed one left
        # waiting (a second failure deletes them).
        self._taken: tuple[dict, dict, dict] = ({}, {}, {})
        self._refused_once: set[str] = set()

    # -- adding ---------------------------------------------------------------------------------------

    def create(self, event: protocol.ConversationItemCreate) -> None:
        """`conversation.item.create`: checked, echoed, waiting for the next response."""
        item = event.item
        # "root": OpenAI's beginning, which is the end of an empty conversation
        at_root = event.previous_item_id == "root" and self.last_item_id is None
        if event.previous_item_id not in (None, self.last_item_id) and not at_root:
            raise ProtocolError(
                "invalid_value",
                "items can only be added at the end of the conversation (previous_item_id must be the "
                f"last item, {self.last_item_id!r})",
                param="previous_item_id",
                event_id=event.event_id,
            )
        try:
            role, text = protocol.item_turn(item)
        except ProtocolError as exc:
            exc.event_id = event.event_id
            raise
        pending = sum(len(t) for _, t in self._text.values()) + len(text)
        if pending > self.max_text_chars:
            raise ProtocolError(
                "pending_input_full",
                f"at most {self.max_text_chars} characters of text wait for a response ({pending} with "
                "this message): send response.create, or a shorter message",
                event_id=event.event_id,
            )
        item_id = item.id or wire.new_id("item")
        if item_id in self._items:
            raise ProtocolError(
                "invalid_value", f"the conversation already has an item {item_id!r}", param="item.id",
                event_id=event.event_id,
            )  # fmt: skip
        self._text[item_id] = (role, text)
        self._add(protocol.item_wire(item, item_id, text))

    def add_speech(self, item_id: str, audio: np.ndarray, clip: Any = None) -> None:
        """A committed spoken turn (16 kHz), a user item; `clip`: its `SpeechClip` (live_turn.py)."""
        self._speech[item_id] = audio
        if clip is not None:
            self._clips[item_id] = clip
        self._add(wire.input_audio_item(item_id))

    def place(self, item: dict[str, Any]) -> str | None:
        """An item a response announces (it sends `conversation.item.added` / `.done` itself), as it is
        now. The first time, it joins the end of the conversation, as OpenAI's does: it can be retrieved
        and named as `previous_item_id` while the reply runs, and items created meanwhile follow it;
        the id of the item before it is returned. After that it is updated in its place (None)."""
        if item["id"] in self._items:
            self._items[item["id"]] = item
            return None
        previous = self.last_item_id
        self._keep(item)
        return previous

    def _add(self, item: dict[str, Any]) -> None:
        self._send(wire.conversation_item_added(item, self.last_item_id))
        self._send(wire.conversation_item_done(item, self.last_item_id))
        self._keep(item)

    def _keep(self, item: dict[str, Any]) -> None:
        self._items[item["id"]] = item
        while len(self._items) > KEPT_ITEMS:
            self._items.popitem(last=False)
        self.last_item_id = item["id"]

    # -- what waits for a response -------------------------------------------------------------------

    @property
    def speech_samples(self) -> int:
        return sum(map(len, self._speech.values()))

    def waiting(self) -> tuple[list[tuple[str, str]], bool]:
        """(the text turns waiting, whether speech waits too)."""
        return list(self._text.values()), bool(self._speech)

    def unanswerable(self, event_id: str | None = None) -> ProtocolError | None:
        """Why the input waiting cannot be one reply's, or None: an assistant message cannot join a spoken
        turn (its words would be heard as the user's, beside the speech)."""
        if self._speech and any(role == "assistant" for role, _ in self._text.values()):
            return ProtocolError(
                "invalid_value",
                "a spoken turn is answered with the user text beside it and the system messages before "
                "it; assistant messages cannot join it: send response.create before adding them, or "
                "delete them",
                event_id=event_id,
            )
        return None

    def take(self) -> tuple[list[tuple[str, str]], Any]:
        """What the next response reads: the text turns in order, the speech as one clip (the item's
        encoding made while it was spoken when one item waits, else the samples of all of them)."""
        turns = list(self._text.values())
        speech = self.speech_clip() or (np.concatenate(list(self._speech.values())) if self._speech else None)
        self._taken = (self._text, self._speech, self._clips)
        self._text, self._speech, self._clips = {}, {}, {}
        return turns, speech

    def refused(self) -> None:
        """The last response failed, so the model never read its input: that input waits again, ahead of
        any added since. Items it had already left waiting once are deleted instead (sent as
        `conversation.item.deleted`)."""
        text, speech, clips = self._taken
        self._taken = ({}, {}, {})
        self._text, self._speech = {**text, **self._text}, {**speech, **self._speech}
        self._clips = {**clips, **self._clips}
        gone = [i for i in (*text, *speech) if i in self._refused_once]  # in the order they came
        self._refused_once = {*text, *speech}
        for item_id in gone:
            self._forget(item_id)  # and no longer marked

    def speech_clip(self) -> Any:
        """The encoding of the one spoken item waiting, if it has one (None otherwise)."""
        if len(self._speech) != 1:
            return None
        return self._clips.get(next(iter(self._speech)))

    # -- retrieve, delete -----------------------------------------------------------------------------

    def retrieve(self, event: protocol.ConversationItemRetrieve) -> None:
        item = self._items.get(event.item_id)
        if item is None:
            raise ProtocolError(
                "invalid_value", f"no item {event.item_id!r}", param="item_id", event_id=event.event_id
            )
        self._send(wire.conversation_item_retrieved(item))

    def delete(self, event: protocol.ConversationItemDelete) -> None:
        """Input not yet answered can be taken back; what a response has read is in the model's
        context (its KV cache), which is not rewritten."""
        item_id = event.item_id
        if item_id not in self._text and item_id not in self._speech:
            known = item_id in self._items
            raise ProtocolError(
                "item_delete_unsupported" if known else "invalid_value",
                f"item {item_id!r} is in the model's context already: only items added since the last "
                "response can be deleted"
                if known
                else f"no item {item_id!r}",
                param="item_id",
                event_id=event.event_id,
            )
        self._forget(item_id)

    def _forget(self, item_id: str) -> None:
        """A waiting item leaves the conversation; the client is told."""
        self._text.pop(item_id, None)
        self._speech.pop(item_id, None)
        self._clips.pop(item_id, None)
        self._refused_once.discard(item_id)
        self._items.pop(item_id, None)  # it may be older than the items kept
        if self.last_item_id == item_id:
            self.last_item_id = next(reversed(self._items), None)
        self._send(wire.conversation_item_deleted(item_id))
