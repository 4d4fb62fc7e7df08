"""What a Session may ask of the engine that hosts it: the whole of their interface.

The Engine hands each Session a `SessionHost` (engine.py's `_Host`) and the `Ticket` of its slot
(omni_rt.admission); session.py and speculation.py use nothing else of the engine, and import neither
engine.py nor the pipeline's scheduler, so there is no engine ↔ session import circle:

    engine.py ──→ session.py ──→ host.py (this Protocol), admission.py
        └────────────────────────↗ (implements it)

A fake host (tests) is any object with these members.
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
    """The engine as its sessions see it. Methods are called on the session's event loop."""

    @property
    def settings(self) -> EngineSettings:
        """The engine's settings (context lengths, event queue bound)."""
        ...

    @property
    def ids(self) -> TokenIds:
        """The model's special token ids."""
        ...

    @property
    def vocab_size(self) -> int:
        """The Thinker's vocabulary: a verbatim prompt's ids are below it."""
        ...

    @property
    def audio_window(self) -> int:
        """The audio encoder's `n_window` (how many placeholders a spoken turn's features make)."""
        ...

    @property
    def tokenizer(self) -> Any:
        """The chat template and detokeniser (`omni_rt.tokenizer.Tokenizer`)."""
        ...

    @property
    def running(self) -> bool:
        """Whether the pipeline runs (a request can be submitted)."""
        ...

    @property
    def generation(self) -> int:
        """Which run of the pipeline this is: it grows at each start, whose caches are new and empty. A
        session that cached its conversation in another generation must prefill it again."""
        ...

    @property
    def speech_worker(self) -> SpeechWorker | None:
        """The engine's live-speech encoder thread; None where there is none."""
        ...

    def speaker_id(self, voice: str) -> int:
        """The codec id of a voice; InvalidRequestError for an unknown one."""
        ...

    def submit(self, req: Request) -> None:
        """Start a request in the pipeline (its messages go to `req.sink`); EngineClosedError if stopped."""
        ...

    def cancel(self, req: Request) -> None:
        """Stop a request; it ends with a `cancelled` DoneOut (nothing where the engine is stopped)."""
        ...

    def fail(self, req: Request, exc: Exception) -> None:
        """End a request with `exc` (an ErrorOut, then a `failed` DoneOut)."""
        ...
