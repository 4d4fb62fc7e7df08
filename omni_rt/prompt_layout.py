"""Torch-free rules of the prompt layout that the model, the pipeline stages and the Session share.

Which Thinker-vocabulary id the Talker reads at each decode step (`talker_text_id`) is one rule: the
offline model path (`model/offline.py`), the Talker runner's inputs and the scheduler's Talker thread all
call this function, so the streaming and offline paths cannot drift apart. So is which prompt positions
the Talker's prompt takes (`user_turn_positions`): the Talker's prompt builder gathers them, and the
Session counts them for the Talker's cache (`talker_prompt_len`).
"""

from __future__ import annotations

from collections.abc import Sequence

from omni_rt.model.config import TokenIds

__all__ = [
    "TALKER_PROMPT_EXTRA",
    "count_user_tokens",
    "talker_prompt_len",
    "talker_text_id",
    "user_turn_positions",
]

# the Talker's prompt: its user-turn tokens, then 8 assistant positions and the first token's
TALKER_PROMPT_EXTRA = 9


def user_turn_positions(ids: Sequence[int], im_start: int, user: int) -> list[int]:
    """Positions inside user turns: those whose turn's role (the token after the last `<|im_start|>` at
    or before them) is `user`. A turn runs from its `<|im_start|>` up to (not including) the next one, so
    it includes the `<|im_end|>` and the `\\n` after it. Tokens before any `<|im_start|>` take the role of
    token 1, as in the reference."""
    out, role = [], ids[1] if len(ids) > 1 else None
    for i, tok in enumerate(ids):
        if tok == im_start:
            role = ids[i + 1] if i + 1 < len(ids) else None
        if role == user:
            out.append(i)
    return out


def count_user_tokens(ids: Sequence[int], im_start: int, user: int) -> int:
    """How many positions of `ids` the Talker's prompt takes from user turns (`user_turn_positions`)."""
    return len(user_turn_positions(ids, im_start, user))


def talker_prompt_len(ids: Sequence[int], tok: TokenIds) -> int:
    """Positions of the Talker's whole prompt for the chat prompt `ids` (its prefix and the first token's)."""
    return count_user_tokens(ids, tok.im_start, tok.user) + TALKER_PROMPT_EXTRA


def talker_text_id(
    text_tokens: Sequence[int], step: int, text_done: bool, ids: TokenIds, ignore_eos: bool = False
) -> int | None:
    """Which Thinker-vocabulary id the Talker reads at decode step `step` (>= 1), or None to wait for text.

    Step k reads generated token k (token 0 went into the prefill). The text ends at the first
    `<|im_end|>` (not spoken) or, once the Thinker is done, at its last token; the step right after the
    text reads `tts_eos`, every later one `tts_pad`. While the Thinker is still running and token k is not
    out yet, the answer is None: the Talker must wait for it. With `ignore_eos`, `<|im_end|>` is text too.

    (The reference's `generate` reads the same stream, except that when the Thinker stops at its token
    limit rather than at `<|im_end|>` it never speaks the last generated token: it builds the text from
    the Thinker's input embeddings, which lack the final token. We speak every generated token.)
    """
    if step < 1:
        raise ValueError(f"talker decode steps start at 1, got {step}")
    n = len(text_tokens)
    if not ignore_eos:
        for j, tok in enumerate(text_tokens):
            if tok == ids.im_end:
                n, text_done = j, True
                break
    if step < n:
        return int(text_tokens[step])
    if not text_done:
        return None
    return ids.tts_eos if step == max(n, 1) else ids.tts_pad
