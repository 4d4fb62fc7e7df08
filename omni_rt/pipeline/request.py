"""A request as the pipeline sees it, and the messages the pipeline sends back to its session.

Plain Python, no torch: the scheduler and its tests never touch tensors. A request is written by the
stage threads (each field by one stage) and read by the session only through the messages below, which
the pipeline posts to the session's event loop in order.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from omni_rt.config import Sampling

STAGES = ("thinker", "talker", "code2wav")


# ---------------------------------------------------------------------------------------------------------
# Messages to the session (posted through `Request.sink`, in order)


@dataclass(frozen=True)
class TextOut:
    token_id: int  # a generated Thinker token (the end-of-turn token included; the session skips it)


@dataclass(frozen=True)
class TranscriptOut:
    token_id: int  # a text token the Talker has just spoken (read into a codec frame)


@dataclass(frozen=True)
class AudioOut:
    pcm: Any  # float32 numpy [samples] at 24 kHz
    frame_index: int  # first codec frame of this chunk
    num_frames: int


@dataclass(frozen=True)
class AudioDoneOut:
    pass


@dataclass(frozen=True)
class ErrorOut:
    error: BaseException


@dataclass(frozen=True)
class DoneOut:
    status: Literal["completed", "cancelled", "failed"]


Message = TextOut | TranscriptOut | AudioOut | AudioDoneOut | ErrorOut | DoneOut


# ---------------------------------------------------------------------------------------------------------
# Request


@dataclass(eq=False)
class Request:
    """One response being generated. `eq=False`: requests are compared and hashed by identity."""

    id: str
    slot: int  # the session's row in every stage's cache, held for the session's life
    prompt_ids: list[int]  # the whole conversation up to this turn's assistant header
    thinker_start: int  # prompt_ids[:thinker_start] are already in the Thinker's cache for this slot
    talker_start: int  # Talker cache positions reused from earlier turns (their user-turn tokens)
    speaker_id: int
    sampling: Sampling
    max_output_tokens: int
    max_audio_frames: int
    sink: Callable[[Message], None]  # thread-safe post to the session
    t0: float  # respond() time on the pipeline's clock
    ignore_eos: bool = False  # benchmark: run to the length limits
    # speech input of this turn: the clips' log-mel features, opaque to the scheduler (the Thinker
    # runner encodes them). The Talker then reads the Thinker's hidden states at the audio positions,
    # so its prompt prefix waits for the Thinker's prefill instead of overlapping it.
    audio_features: list[Any] | None = None
    # each clip's encoder tokens, when the session encoded the turn while it was spoken (else None)
    audio_encoded: list[Any] | None = None
    thinker_hidden: Any = None  # [len(prompt_ids), H] set by the Thinker runner for the Talker runner
    # [n, H]: the Thinker's hidden states of prompt_ids[:n] that the Talker has not prefilled yet (an
    # earlier spoken turn whose reply was cut before the Talker's prefill): its audio positions are in
    # this turn's Talker prompt, and the Thinker, which has them cached, will not compute them again
    carried_hidden: Any = None
    seed: int = field(init=False)  # every stage's draws of this response (model/sampling.py)

    # state written by the stages
    prefilled: int = 0  # tokens of new_prompt_ids already in the Thinker's cache (a long prompt's pieces)
    tokens: list[int] = field(default_factory=list)  # generated text tokens, in order (Thinker)
    text_done: bool = False  # the Thinker will send no more tokens
    frames: int = 0  # codec frames emitted (Talker)
    samples: int = 0  # 24 kHz samples emitted (Code2Wav)
    error: BaseException | None = None
    cancelled: bool = False
    # frame 0 is pending: the Talker has the first token and can make frame 0 without more text; with
    # `yield_until="first_audio"` the flag stays up until the first PCM chunk is out
    frame0_pending: bool = False
    talker_prefilled: bool = False  # the Talker's prompt prefix is in its cache (multi-turn reuse)
    # how the Thinker's one wait for this request's frame 0 (or first audio) ended: "first_audio" /
    # "frame0" (what it waited for came), "cap", "stop", or "not_needed" (it was out before the Thinker's
    # next step); None: no wait yet, or no yield configured
    yield_outcome: str | None = None

    # timestamps on the pipeline's clock (None until they happen)
    t_thinker_first: float | None = None
    t_thinker_last: float | None = None
    t_talker_first_code: float | None = None
    t_first_pcm: float | None = None
    t_done: float | None = None

    # the stages still holding the request; the last to let go posts DoneOut
    holders: set[str] = field(default_factory=lambda: set(STAGES))
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self.seed = self.sampling.response_seed()

    @property
    def stopped(self) -> bool:
        """Cancelled or failed: every stage drops it at its next step."""
        return self.cancelled or self.error is not None

    @property
    def status(self) -> Literal["completed", "cancelled", "failed"]:
        if self.error is not None:
            return "failed"
        return "cancelled" if self.cancelled else "completed"

    @property
    def needs_thinker_hidden(self) -> bool:
        return self.audio_features is not None

    @property
    def new_prompt_ids(self) -> list[int]:
        """What the Thinker must prefill for this turn."""
        return self.prompt_ids[self.thinker_start :]

    @property
    def prefill_start(self) -> int:
        """The position of the first prompt token the Thinker has not written yet."""
        return self.thinker_start + self.prefilled

    @property
    def pending_prompt_ids(self) -> list[int]:
        """The part of this turn's prompt the Thinker has still to prefill (all of it but for the pieces
        of a long prompt already written)."""
        return self.prompt_ids[self.prefill_start :]
