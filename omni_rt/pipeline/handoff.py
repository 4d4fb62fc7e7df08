"""The messages the stage threads send each other through their inboxes (`inbox.Inbox`).

Each names the request it is about (`req`). To the Thinker: `Admit`, `Stop`, `Progress`, `Spoken`. To
the Talker: `Prefix`, `FirstTokenQueued`, `FirstToken`, `TextToken`, `TextEnd`, `Stop`. To Code2Wav:
`FrameQueued`, `Frame`, `AudioEnd`, `Stop`. What goes to the session is in `request.py` (`TextOut`, `AudioOut`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass

from omni_rt.pipeline.request import Request


@dataclass(frozen=True, eq=False)
class Handoff:
    req: Request


class Admit(Handoff):
    """A new request for the Thinker."""


class Stop(Handoff):
    """The request was cancelled or failed: every stage lets go of it."""


class Progress(Handoff):
    """A frame was spoken: a Thinker holding the request at its text lead may go on."""


class Spoken(Handoff):
    """The Talker has said its last (codec end, audio cap): the spoken text is the reply, so it ends."""


class Prefix(Handoff):
    """Prefill the Talker's prompt prefix."""


@dataclass(frozen=True, eq=False)
class FirstTokenQueued(Handoff):
    """The reply's first text token is enqueued on the device, not read back yet (`early_start`): the
    Talker may enqueue its last prompt position and frame 0 behind it. `ready`: what its stream waits for
    (a CUDA event; None off the GPU). `FirstToken` follows, unless the reply is empty."""

    ready: object


@dataclass(frozen=True, eq=False)
class FirstToken(Handoff):
    """The reply's first text token: the Talker's last prompt position, then frame 0."""

    token: int


@dataclass(frozen=True, eq=False)
class TextToken(Handoff):
    """The next text token."""

    token: int


class TextEnd(Handoff):
    """The Thinker will send no more text for the request."""


@dataclass(frozen=True, eq=False)
class Frame(Handoff):
    """A codec frame (16 codes) for Code2Wav, `index` in the response."""

    codes: list[int]
    index: int


@dataclass(frozen=True, eq=False)
class FrameQueued(Handoff):
    """Frame 0 is enqueued on the device, not read back yet (`early_start`): Code2Wav may enqueue its
    first chunk behind it. `ready` as `FirstTokenQueued`'s. `Frame` 0 follows, unless the audio ends first."""

    ready: object


class AudioEnd(Handoff):
    """The Talker will send no more frames for the request."""
