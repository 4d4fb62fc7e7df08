"""What a Session may ask of the engine that hosts it: the whole of their interface.

The Engine hands each Session a `SessionHost` (engine.py's `_Host`) and the `Ticket` of its slot
(omni_rt.admission); session.py and speculation.py use nothing else of the engine, and import neither
engine.py nor the pipeline's scheduler, so there is no engine ↔ session import circle:

    engine.py ──→ session.py ──→ host.py (this Protocol), admission.py
        └──────── implements SessionHost

A fake host (tests) is any object with these members. Methods are called on the session's event loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from omni_rt.config import EngineSettings
    from omni_rt.live_speech import SpeechWorker
    from omni_rt.model.config import TokenIds
    from omni_rt.pipeline.request import Request

__all__ = ["SessionHost"]


class SessionHost(Protocol):
    """The engine as its sessions see it."""

    settings: EngineSettings  # the engine's (context lengths, the event queue's bound)
    ids: TokenIds  # the model's special token ids
    vocab_size: int  # the Thinker's vocabulary: a verbatim prompt's ids are below it
    audio_window: int  # the audio encoder's `n_window` (a spoken turn's placeholder count)
    tokenizer: Any  # the chat template and detokeniser (omni_rt.tokenizer.Tokenizer)
    running: bool  # whether the pipeline runs (a request can be submitted)
    # which run of the pipeline this is: it grows at each start, whose caches are new and empty; a
    # session that cached its conversation in another generation prefills it again
    generation: int
    speech_worker: SpeechWorker | None  # the live-speech encoder thread; None where there is none

    def speaker_id(self, voice: str) -> int:
        """The codec id of a voice; InvalidRequestError for an unknown one."""
        ...

    def submit(self, req: Request) -> None:
        """Start a request in the pipeline (its messages go to `req.sink`); EngineClosedError if stopped."""
        ...

    def cancel(self, req: Request) -> None:
        """Stop a request: it ends with a `cancelled` DoneOut (nothing where the engine is stopped)."""
        ...

    def fail(self, req: Request, exc: Exception) -> None:
        """End a request with `exc`: an ErrorOut, then a `failed` DoneOut."""
        ...
