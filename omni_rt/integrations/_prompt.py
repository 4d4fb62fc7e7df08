"""What a reply answers, shared by the framework adapters: the user's spoken turn (if any) and the text
messages the app added since the last reply, as `Session.respond`'s prompt arguments.

omni_rt's spoken turns take text beside the audio in the same user turn: with speech, the user and
assistant messages become text after it, and the system messages (new instructions) a system turn just
before it (`Session.respond(instructions=...)`). Without speech they are chat-formatted turns (system, user or
assistant) ending with the assistant's header; the session's first turn then carries its instructions,
as `Session.respond(text=...)` would.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from omni_rt.integrations._audio import SPEECH_RATE
from omni_rt.tools import system_due

# the frameworks' message roles as chat-template roles (OpenAI's "developer" is a system turn)
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def reply_prompt(
    session: Any, tokenizer: Any, messages: list[tuple[str, str]], audio: np.ndarray | None
) -> dict[str, Any]:
    """`Session.respond` keyword arguments answering `audio` (16 kHz mono, or None) and `messages`."""
    if audio is not None:  # system messages: a system turn before the spoken one; the rest beside it
        system = "\n".join(t for role, t in messages if role == "system") or None
        text = "\n".join(t for role, t in messages if role != "system") or None
        return dict(audio=audio, audio_sample_rate=SPEECH_RATE, text=text) | (
            {"instructions": system} if system is not None else {}
        )
    if not session.conversation and session.settings.instructions:
        messages = [("system", session.settings.instructions), *messages]  # a verbatim prompt has none
    return dict(input_ids=tokenizer.chat_prompt(messages))


def system_turn(session: Any, tokenizer: Any, system: str) -> list[tuple[str, str]] | None:
    """The system turn the next reply starts with, where the system prompt (instructions, tools) changed:
    [] when the model last heard `system`; [("system", system)] once the conversation has begun (nothing
    heard can be rewritten: the new prompt is a turn of its own, `omni_rt.tools.system_due`, as
    `omni-rt serve` adds it); None before anything was said, when the session's own instructions are not
    `system`: the caller then opens the session anew with it, and its first turn says it."""
    if not session.conversation:
        return [] if system == (session.settings.instructions or "") else None
    due = system_due(session.conversation, tokenizer, system)
    return [] if due is None else [("system", due)]


def users_words(messages: list[tuple[str, str]], refused: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """What of a refused reply's messages (one the model never heard: too long, ...) waits for the next
    reply beside the user's speech: the user's words. The instructions or context sent with them are not
    kept: they may be what made it too long; nor are the words `refused` already once (the words this
    returned for the reply before, the very objects): refused twice, they are what does not fit, and kept
    again they would fail every reply after them."""
    return [m for m in messages if m[0] == "user" and not any(m is r for r in refused)]
