"""The LiveKit realtime session's chat context (`livekit.py`): what the framework's `update_chat_ctx` hands
over, against what the model has heard. New text messages and function outputs join the next reply's
prompt; items the model has not heard yet follow the framework's context, as OpenAI's plugin deletes and
recreates the server's items (one removed is not said, an edited message is said as edited, in the
context's order); removing an item the model heard is a `RealtimeError` (omni_rt's caches cannot be
rewound). Nothing is half-applied: every item is checked before anything changes.
"""

from __future__ import annotations

from typing import Any

from livekit.agents import llm
from livekit.agents.voice.generation import remove_instructions

from omni_rt.integrations._prompt import ROLES
from omni_rt.integrations.livekit_tools import SessionTools

Turn = tuple[str, str]  # (role, text): a turn of the next reply's prompt


def update_chat_ctx(
    ours: llm.ChatContext, pending: dict[str, Turn], tools: SessionTools, chat_ctx: llm.ChatContext
) -> dict[str, Turn]:
    """Bring `ours` (the session's chat context, changed in place) up to the framework's `chat_ctx`;
    `pending`: the turns of the items the model has not heard yet, by item id. Returns them as they are now."""
    # as OpenAI's plugin: the framework's own bookkeeping items and the agent's instructions (which
    # update_instructions carries) are not conversation
    chat_ctx = chat_ctx.copy(exclude_handoff=True, exclude_config_update=True)
    remove_instructions(chat_ctx)
    new_ids = {item.id for item in chat_ctx.items}
    known = {item.id for item in ours.items}
    heard = [i for i in known - new_ids if i not in pending]
    if heard:
        raise llm.RealtimeError(f"omni_rt cannot remove items the model has already heard: {sorted(heard)}")
    added: list[tuple[Any, Turn | None]] = []
    edited: dict[str, Turn] = {}
    answering: set[str] = set()
    for item in chat_ctx.items:
        if item.type in ("function_call", "function_call_output"):
            if item.id not in known:
                added.append((item, tools.turn(item, answering)))
        elif item.id not in known:
            added.append((item, message_turn(item)))
        elif item.id in pending and (turn := message_turn(item)) != pending[item.id]:
            edited[item.id] = turn  # (a turn left as it was stays the same object: `users_words`)
    # the unheard items, in the framework's order and as it has them now, in the places they had
    unheard = iter([item for item in chat_ctx.items if item.id in pending])
    items = []
    for item in ours.items:
        if item.id not in pending:
            items.append(item)
        elif (now := next(unheard, None)) is not None:
            items.append(now)
        elif item.type == "function_call_output":
            tools.unanswered(item.call_id)  # its output went before the model heard it
    ours.items[:] = items
    pending = {i.id: edited.get(i.id, pending[i.id]) for i in items if i.id in pending}
    for item, turn in added:
        if turn is None:  # a call the model made, under another item id: it was heard as it was made
            continue
        if item.type == "function_call_output":
            tools.answered(item.call_id)
        ours.insert(item)
        pending[item.id] = turn
    return pending


def message_turn(item: Any) -> Turn:
    """A chat item the model is to hear as a turn: a text message (system, user or assistant)."""
    role = ROLES.get(getattr(item, "role", None)) if item.type == "message" else None
    text = item.text_content if role is not None else None
    if role is None or not text:
        raise llm.RealtimeError(
            "omni_rt takes text messages and function calls and outputs in the chat context; "
            f"item {item.id} is a {item.type}"
            + (f" ({item.role} without text)" if item.type == "message" else "")
        )
    return role, text
