"""One response's pipeline messages -> its Realtime events, as the caller reads them (the session's
half that knows events; `session.py` keeps the conversation and the caches).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from omni_rt.audio.resample import StreamingResampler
from omni_rt.events import (
    ErrorEvent,
    Event,
    Metrics,
    ResponseDone,
    ResponseOutputAudioDelta,
    ResponseOutputAudioDone,
    ResponseOutputAudioTranscriptDelta,
    ResponseOutputTextDelta,
    Usage,
)
from omni_rt.pipeline.request import (
    AudioDoneOut,
    AudioOut,
    DoneOut,
    ErrorOut,
    Request,
    TextOut,
    TranscriptOut,
)

NATIVE_RATE = 24000


async def response_events(
    resp: Any, rid: str, rate: int, t0: float, tokenizer: Any, ids: Any
) -> AsyncIterator[Event]:
    """The Realtime events of one response, from its pipeline messages as they land in `resp.queue`:
    text detokenised, PCM resampled to `rate` as int16; after a cancel only the end goes out."""
    req = resp.req
    tok = tokenizer
    text_dec = tok.incremental()
    transcript_dec = tok.incremental()
    resampler = None if rate == NATIVE_RATE else StreamingResampler(NATIVE_RATE, rate)
    t_text = t_audio = None
    delivered = 0  # samples handed out, at `rate`
    error = None
    while True:
        msg = await resp.queue.get()
        live = not resp.cancel_requested  # after a cancel, only the end goes out
        if isinstance(msg, TextOut):
            if not live or (msg.token_id == ids.im_end and not req.ignore_eos):
                continue
            if t_text is None:
                t_text = time.perf_counter()
            yield ResponseOutputTextDelta(
                response_id=rid, delta=text_dec.push(msg.token_id), token_ids=[msg.token_id]
            )
        elif isinstance(msg, TranscriptOut):
            delta = transcript_dec.push(msg.token_id) if live else ""
            if delta:
                yield ResponseOutputAudioTranscriptDelta(response_id=rid, delta=delta)
        elif isinstance(msg, AudioOut):
            if not live:
                continue
            pcm = msg.pcm if resampler is None else resampler.push(msg.pcm)
            if len(pcm) == 0:
                continue
            if t_audio is None:
                t_audio = time.perf_counter()
            delivered += len(pcm)
            yield ResponseOutputAudioDelta(
                response_id=rid, pcm=_to_int16(pcm), sample_rate=rate, frame_index=msg.frame_index,
                num_frames=msg.num_frames,
            )  # fmt: skip
        elif isinstance(msg, AudioDoneOut):
            if not live:
                continue
            if resampler is not None:
                tail = resampler.flush()
                if len(tail):
                    delivered += len(tail)
                    yield ResponseOutputAudioDelta(
                        response_id=rid, pcm=_to_int16(tail), sample_rate=rate, frame_index=req.frames,
                        num_frames=0,
                    )  # fmt: skip
            # what was spoken is complete, and so is the text when the Thinker is done: a last
            # character cut short (max_output_tokens) comes out before the audio's end
            for ev in _flushed(rid, transcript_dec, text_dec if req.text_done else None):
                yield ev
            yield ResponseOutputAudioDone(response_id=rid)
        elif isinstance(msg, ErrorOut):
            error = ErrorEvent.from_exception(msg.error, rid)
            yield error
        elif isinstance(msg, DoneOut):
            if not resp.cancel_requested:  # whatever is still held back (no audio, or text after it)
                for ev in _flushed(rid, transcript_dec, text_dec):
                    yield ev
            status = msg.status
            if resp.cancel_requested and status == "completed":
                status = "cancelled"  # finished before the cancel landed; the caller asked to stop
            yield ResponseDone(
                response_id=rid,
                status=status,
                usage=Usage(
                    input_tokens=len(req.new_prompt_ids),
                    cached_tokens=req.thinker_start,
                    output_tokens=len(req.tokens),
                    audio_frames=req.frames,
                ),
                metrics=_metrics(req, t0, t_text, t_audio, delivered / rate, resp.held_ms),
                error=None if error is None else error.error,
            )
            return


def _flushed(rid: str, transcript_dec: Any, text_dec: Any | None) -> list[Event]:
    """The bytes the incremental decoders still hold back (a reply cut mid-character, decoded as U+FFFD),
    as last deltas, so that a response's deltas add up to the decode of all its ids."""
    out: list[Event] = []
    tail = transcript_dec.flush()
    if tail:
        out.append(ResponseOutputAudioTranscriptDelta(response_id=rid, delta=tail))
    tail = text_dec.flush() if text_dec is not None else ""
    if tail:
        out.append(ResponseOutputTextDelta(response_id=rid, delta=tail, token_ids=[]))
    return out


def _to_int16(pcm: np.ndarray) -> np.ndarray:
    return (np.clip(pcm, -1.0, 1.0) * 32767.0).round().astype(np.int16)


def _ms(t: float | None, t0: float) -> float | None:
    return None if t is None else (t - t0) * 1000.0


def _metrics(
    req: Request, t0: float, t_text: float | None, t_audio: float | None, audio_s: float, held_ms=None
) -> Metrics:
    """audio_s: seconds of audio handed to the caller (none of what a cancel dropped). total_ms runs to
    the caller reading response.done, like ttft and ttfa; rtf is the pipeline's: its generation ends
    when the last stage lets go of the response, however long the caller takes to read it."""
    t_end = time.perf_counter()
    t_gen = t_end if req.t_done is None else req.t_done
    n = len(req.tokens)
    tps = None
    if n > 1 and req.t_thinker_first is not None and req.t_thinker_last is not None:
        span = req.t_thinker_last - req.t_thinker_first
        tps = (n - 1) / span if span > 0 else None
    return Metrics(
        ttft_ms=_ms(t_text, t0),
        ttfa_ms=_ms(t_audio, t0),
        thinker_first_token_ms=_ms(req.t_thinker_first, t0),
        talker_first_code_ms=_ms(req.t_talker_first_code, t0),
        first_pcm_ms=_ms(req.t_first_pcm, t0),
        total_ms=(t_end - t0) * 1000.0,
        text_tokens_per_s=tps,
        audio_seconds=audio_s,
        rtf=(t_gen - t0) / audio_s if audio_s > 0 else None,
        held_ms=held_ms,
        thinker_yield=req.yield_outcome,
    )
