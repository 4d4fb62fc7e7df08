"""What the scheduler needs from each stage runner. Plain Python types at this seam: token ids and codes
are ints, PCM is a float32 numpy array. The real runners (`runners.py` builds them) own the tensors, caches and
graphs behind it; the fake ones (`fake.py`) script durations for the policy tests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from omni_rt.pipeline.request import Request

Queued = Callable[[list[Request], object], None]  # ThinkerStage.prefill's `queued`


class ThinkerStage(Protocol):
    def prefill(self, reqs: list[Request], queued: Queued | None = None) -> list[int]:
        """Feed each request's `pending_prompt_ids` at positions `prefill_start`...; return the first
        tokens. `queued` (`early_start` only): called with `reqs` and what a stream waits for before
        reading their first tokens on the device, once they are enqueued there and before the host
        reads them back."""
        ...

    def prefill_piece(self, req: Request, n: int) -> None:
        """Feed the next `n` of a text request's `pending_prompt_ids` (a long prompt in pieces); advance
        `req.prefilled`. The first token comes from `prefill`, of the rest."""
        ...

    def decode(self, reqs: list[Request]) -> list[int]:
        """One step for every request: feed its last token at its next position; return the next tokens."""
        ...


class TalkerStage(Protocol):
    def prefill_prefix(self, reqs: list[Request]) -> None:
        """Feed every Talker prompt position but the last of each request (needs only the prompt ids)."""
        ...

    def queue_last(self, reqs: list[Request], ready: object) -> object:
        """`early_start`: enqueue what `prefill_last` computes for `reqs`, reading their first tokens on the
        device after `ready` (the Thinker's); `prefill_last` then reads it back. Returns what a stream
        waits for before reading their frames 0 on the device (None: no frame 0 was made)."""
        ...

    def prefill_last(self, reqs: list[Request], first_tokens: list[int]) -> list[int]:
        """Feed each request's last prompt position (its first text token + codec bos); return code 0 of
        each one's frame 0."""
        ...

    def predict(self, reqs: list[Request], code0: list[int]) -> list[list[int]]:
        """The code predictor: the frame's 16 codes for each request, from its last Talker step."""
        ...

    def step(self, reqs: list[Request], frames: list[list[int]], text_ids: list[int]) -> list[int]:
        """One Talker step: input = the previous frame's code embeddings + the projected text id.
        Returns the next frame's code 0 for each request."""
        ...


class Code2WavStage(Protocol):
    samples_per_frame: int

    def open(self, req: Request) -> None: ...

    def queue_first(self, req: Request, ready: object) -> None:
        """`early_start`: open the request's stream and enqueue the decode of its frame 0, read on the
        device after `ready` (the Talker's); its first `push` then reads the PCM back."""
        ...

    def push(self, req: Request, frames: list[list[int]]) -> np.ndarray:
        """Decode more frames of the request's stream: float32 PCM (exact streaming)."""
        ...

    def push_many(self, reqs: list[Request], frames: list[list[list[int]]]) -> list[np.ndarray]:
        """The next chunk of each request (of any sizes) in one call: each request's PCM as `push`
        gives it (one request: its `push`)."""
        ...

    def flush(self, req: Request) -> np.ndarray: ...

    def close(self, req: Request) -> None: ...
