"""The conversation's token layout, in plain Python: turns, how one is closed, and truncation: which of
the oldest turns give way when the conversation outgrows the context.

Truncation is OpenAI Realtime's `truncation`: when the conversation with the new turn exceeds the input limit,
whole turns are dropped from the oldest (after the system turn, which always stays) until it fits a
fraction of that limit (the retention ratio): dropping a little more than needed lets the next turns
reuse the cache instead of truncating again. The session applies it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from omni_rt.model.config import TokenIds

AUTO_RETENTION_RATIO = 0.75  # "auto": what a full conversation keeps of the input limit


def close_turn(conversation: list[int], ids: TokenIds) -> list[int]:
    """Tokens that end the conversation's last assistant turn: `<|im_end|>` (unless the reply had it) and
    `\\n`; none after a user turn kept without a reply, or a system turn (they end closed)."""
    if not conversation or conversation[-2:] == [ids.im_end, ids.newline]:
        return []
    return ([] if conversation[-1] == ids.im_end else [ids.im_end]) + [ids.newline]


def spoken_clips(ids: Sequence[int], tok: TokenIds) -> int:
    """How many spoken clips' placeholders `ids` hold: an `<|audio_start|>` followed by `<|audio_pad|>`.

    Not a bare count of `<|audio_start|>`: a reply can contain that id as text (random weights sample
    any id; the load protocol at 32 conversations met one), and counting it as a clip broke the
    Session's clip bookkeeping (a TypeError in the reply's done callback, the session stuck)."""
    return sum(1 for a, b in zip(ids, ids[1:], strict=False) if a == tok.audio_start and b == tok.audio)


@dataclass(frozen=True)
class Truncation:
    kept: list[int]  # the conversation after the drop: the system turn, then the newest turns
    head: int  # kept[:head] is the system turn (unchanged, so its cache rows stay valid)
    dropped_turns: int
    dropped_tokens: int
    dropped_clips: int  # spoken clips among the dropped turns (their placeholders went with them)


def retention_ratio(truncation: str | float) -> float | None:
    """The fraction of the input limit a truncation keeps; None: truncation is disabled."""
    if truncation == "disabled":
        return None
    return AUTO_RETENTION_RATIO if truncation == "auto" else float(truncation)


def input_limit(context: int, reserve: int) -> int:
    """Tokens a prompt may use of a `context`-long cache, leaving room for `reserve` generated ones (at
    most half the cache: a reply limit as long as the context must not leave no room for a prompt)."""
    return context - min(reserve, context // 2)


def system_head(conversation: Sequence[int], ids: TokenIds) -> int:
    """Length of the system turn that starts the conversation (0 if none)."""
    if len(conversation) < 2 or conversation[0] != ids.im_start or conversation[1] != ids.system:
        return 0
    starts = turn_starts(conversation, ids)
    return starts[1] if len(starts) > 1 else len(conversation)


def turn_starts(conversation: Sequence[int], ids: TokenIds) -> list[int]:
    """Index of each turn's `<|im_start|>`."""
    return [i for i, t in enumerate(conversation) if t == ids.im_start]


def truncate(
    conversation: Sequence[int], ids: TokenIds, fits: Callable[[list[int]], bool]
) -> Truncation | None:
    """Drop whole turns after the system turn, oldest first, until `fits(kept)`; an assistant turn whose
    user turn went goes with it (a reply without its question misleads). None: nothing fits, not even the
    system turn alone (the new turn is too long by itself)."""
    conversation = list(conversation)
    head = system_head(conversation, ids)
    starts = [i for i in turn_starts(conversation, ids) if i >= head] + [len(conversation)]
    for k in range(1, len(starts)):
        cut = starts[k]
        if cut < len(conversation) and conversation[cut + 1 : cut + 2] == [ids.assistant]:
            continue  # never keep a reply whose question was dropped
        kept = conversation[:head] + conversation[cut:]
        if fits(kept):
            dropped = conversation[head:cut]
            return Truncation(
                kept=kept,
                head=head,
                dropped_turns=k,
                dropped_tokens=len(dropped),
                dropped_clips=spoken_clips(dropped, ids),
            )
    return None
