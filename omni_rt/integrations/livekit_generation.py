"""One reply of the LiveKit adapter (`livekit.py`) as the framework sees it: the `Generation` its streams
are fed from, the `GenerationCreatedEvent` that hands them over, and its `RealtimeModelMetrics`."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from livekit.agents import llm, utils
from livekit.agents.metrics import RealtimeModelMetrics
from livekit.agents.metrics.base import Metadata

__all__ = ["FRAME_MS", "Generation", "created_event", "reply_metrics"]

FRAME_MS = 80  # audio of one codec frame; the Talker speaks one text token per frame


@dataclass(eq=False)
class Generation:
    """One reply as the framework sees it; `interrupted` is set first thing by `interrupt()`."""

    message_id: str = field(default_factory=lambda: utils.shortuuid("item_"))
    audio: utils.aio.Chan = field(default_factory=utils.aio.Chan)
    text: utils.aio.Chan = field(default_factory=utils.aio.Chan)
    functions: utils.aio.Chan = field(default_factory=utils.aio.Chan)  # llm.FunctionCall
    response_id: str | None = None
    interrupted: bool = False
    samples: int = 0  # audio handed to the framework, at the session's output rate
    transcript_deltas: list[str] = field(default_factory=list)  # delta k is spoken from k * FRAME_MS
    truncated: str | None = None  # the item's text after truncate()
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def close(self) -> None:
        self.audio.close()
        self.text.close()
        self.functions.close()

    def transcript(self, until_ms: float | None = None) -> str:
        """The transcript, or the part of it whose audio starts before `until_ms` (the Talker takes one
        text token per codec frame; a delta that held back part of a character counts as one token)."""
        deltas = self.transcript_deltas
        return "".join(deltas if until_ms is None else deltas[: max(0, -(-int(until_ms) // FRAME_MS))])


def created_event(gen: Generation, user_initiated: bool) -> llm.GenerationCreatedEvent:
    modalities: asyncio.Future = asyncio.get_running_loop().create_future()
    modalities.set_result(["audio", "text"])
    messages: utils.aio.Chan = utils.aio.Chan()
    messages.send_nowait(
        llm.MessageGeneration(
            message_id=gen.message_id,
            text_stream=until_interrupted(gen.text, gen),
            audio_stream=until_interrupted(gen.audio, gen),
            modalities=modalities,
        )  # fmt: skip
    )
    messages.close()
    return llm.GenerationCreatedEvent(
        message_stream=messages, function_stream=gen.functions, user_initiated=user_initiated,
        response_id=gen.response_id,
    )  # fmt: skip


async def until_interrupted(chan: utils.aio.Chan, gen: Generation) -> Any:
    """The channel's items until it closes, or at once nothing more once the reply is interrupted (what
    was made before the interrupt but not read yet is dropped too: it must not play after it)."""
    async for x in chan:
        if gen.interrupted:
            return
        yield x


def reply_metrics(done: Any, t_created: float, model: llm.RealtimeModel) -> RealtimeModelMetrics:
    """A reply's `metrics_collected`, from its omni_rt `response.done`; `ttft` is the time to first audio."""
    m, u = done.metrics, done.usage
    duration = (m.total_ms or 0.0) / 1000
    return RealtimeModelMetrics(
        label=model.label,
        request_id=done.response_id,
        timestamp=t_created,
        duration=duration,
        ttft=m.ttfa_ms / 1000 if m.ttfa_ms is not None else -1,
        cancelled=done.status == "cancelled",
        input_tokens=u.input_tokens + u.cached_tokens,
        output_tokens=u.output_tokens + u.audio_frames,
        total_tokens=u.input_tokens + u.cached_tokens + u.output_tokens + u.audio_frames,
        tokens_per_second=m.text_tokens_per_s or 0.0,
        input_token_details=RealtimeModelMetrics.InputTokenDetails(
            text_tokens=u.input_tokens, cached_tokens=u.cached_tokens
        ),
        output_token_details=RealtimeModelMetrics.OutputTokenDetails(
            text_tokens=u.output_tokens, audio_tokens=u.audio_frames
        ),
        metadata=Metadata(model_name=model.model, model_provider=model.provider),
    )
