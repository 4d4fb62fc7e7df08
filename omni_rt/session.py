"""Session: one conversation on an engine. `respond()` streams its events; `cancel()` stops the current
response and keeps the session usable.

The session is the bridge between the pipeline's threads and the caller's event loop: the pipeline posts
plain messages with `loop.call_soon_threadsafe`; the session turns them into Realtime events (text
detokenised, PCM resampled to the session's rate as int16) when the caller reads them. It keeps the
conversation and which part of it the stage caches already hold, so a second turn prefills only its
new tokens.

It reaches the engine only through a `SessionHost` (omni_rt.host) and the `Ticket` of its slot
(omni_rt.admission); it imports no engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from omni_rt.config import Sampling, SessionSettings
from omni_rt.conversation import (
    Truncation,
    close_turn,
    input_limit,
    retention_ratio,
    spoken_clips,
    system_head,
    truncate,
)
from omni_rt.errors import (
    CapacityError,
    EngineClosedError,
    InvalidRequestError,
    OmniRtError,
    SessionLimitError,
    StageError,
)
from omni_rt.events import (
    ConversationTruncated,
    ErrorEvent,
    Event,
    ResponseCreated,
    ResponseDone,
)
from omni_rt.live_speech import LiveSpeech
from omni_rt.pipeline.request import (
    DoneOut,
    ErrorOut,
    Message,
    Request,
)
from omni_rt.prompt_layout import TALKER_PROMPT_EXTRA, count_user_tokens, talker_prompt_len
from omni_rt.response_stream import response_events
from omni_rt.turn_input import audio_token_count, check_types, turn_audio

if TYPE_CHECKING:
    from omni_rt.admission import Ticket
    from omni_rt.host import SessionHost
    from omni_rt.speculation import Hold, Speculation

STOP_TIMEOUT_S = 60.0  # the longest a stopping response may take before the pipeline counts as stuck
_response_ids = itertools.count(1)


@dataclass(eq=False)
class _Response:
    req: Request
    queue: asyncio.Queue
    done: asyncio.Event = field(default_factory=asyncio.Event)
    cancel_requested: bool = False
    status: str | None = None
    # a speculative response (omni_rt.speculation) until it is released: its messages wait unread and
    # its turn is not committed (`deferred`: the status it ended with meanwhile)
    held: bool = False
    deferred: str | None = None
    held_ms: float | None = None  # how long its output was held back, once released


@dataclass(eq=False)
class _Starting:
    cancelled: bool = False


class Session:
    """One conversation. Make it with `engine.session(...)`; use it as `async with` or call `close()`.
    `async with` waits for its admission where the engine queues sessions (`admission_wait_s`); so does
    the first `respond()` of a session used without it."""

    def __init__(self, host: SessionHost, ticket: Ticket, settings: SessionSettings, speaker_id: int) -> None:
        self._host = host
        self._ticket = ticket  # its cache slot, or its place in the engine's queue for one
        self.settings = settings
        self.speaker_id = speaker_id
        self.ids = host.ids
        self.conversation: list[int] = []  # every token so far, ending with the last reply
        self._thinker_cached = 0  # conversation[:n] is in the Thinker's cache
        self._talker_cached = 0  # user-turn tokens in the Talker's cache (its positions 0..n-1)
        # the Thinker's hidden states of a spoken turn the Talker never prefilled (its reply was cut before
        # that): the next turn's Talker prompt reads them at that turn's audio positions
        self._talker_hidden = None
        # log-mel features of every clip in the conversation, in order: a prefill of turns the Thinker has
        # not cached (kept without a reply, or kept by a truncation) encodes them again
        self._clips: list[Any] = []
        self._caches_of = host.generation  # the run whose caches hold them (a restart starts empty)
        self._current: _Response | None = None
        self._last: _Response | None = None  # the previous response, until the pipeline lets go of it
        self._starting: set[_Starting] = set()  # responses created but not submitted yet
        self._held: Hold | None = None  # a speculative response not yet released or dropped
        self._closed = False

    # -- lifecycle -------------------------------------------------------------------------------------

    @property
    def slot(self) -> int | None:
        """Its row of every stage cache; None until it is admitted."""
        return self._ticket.slot

    async def __aenter__(self) -> Session:
        if self._closed:  # its ticket is closed too: wait() would say that every slot is in use
            raise InvalidRequestError("this session is closed: open a new one")
        await self._ticket.wait()  # SessionLimitError after admission_wait_s; cancelled: no slot kept
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Cancel any running response and give the slot (or the place in the queue) back to the engine."""
        if self._closed:
            return
        if self._held is not None:  # a speculative reply nobody will hear
            await self._held.speculation.drop()
        await self.cancel()  # a response that will not stop keeps the slot: its request still writes it
        self._closed = True
        self._ticket.close()

    # -- responses -------------------------------------------------------------------------------------

    async def respond(
        self,
        text: str | None = None,
        *,
        input_ids: Sequence[int] | None = None,
        audio: Any = None,
        audio_sample_rate: int = 16000,
        voice: str | None = None,
        sampling: Sampling | None = None,
        max_output_tokens: int | None = None,
        max_audio_frames: int | None = None,
        ignore_eos: bool = False,
        on_event: Callable[[Event], Any] | None = None,
        instructions: str | None = None,
    ) -> AsyncIterator[Event]:
        """Stream one response: response.created, text and audio deltas, ..., response.done (always last).

        `text` goes through the chat template; `input_ids` are appended to the conversation verbatim (a
        whole chat-formatted prompt on the first turn, ending with `<|im_start|> assistant \\n`). `audio`
        (mono float or int16 PCM at `audio_sample_rate`; 24 and 48 kHz are resampled) is a spoken user
        turn, followed by `text` in the same turn if both are given. A bad
        request yields an `error` event and `response.done(status="failed")`. One response at a time:
        breaking out of the loop cancels the response once the dropped iterator is closed (the next
        `respond()` sees to that); `await cancel()` stops it at once. `on_event(ev)` (a function or a
        coroutine function) sees every event just before it is yielded: callbacks on the same stream.
        `instructions` (with `text` or `audio`): a system turn just before this turn, kept in the
        conversation like any turn (the session's own instructions open its first turn); how to change
        a conversation's instructions once it has begun.
        """
        stream = self._respond(
            text, input_ids, (audio, audio_sample_rate), voice, sampling, max_output_tokens,
            max_audio_frames, ignore_eos, instructions=instructions,
        )  # fmt: skip
        async with contextlib.aclosing(stream):  # closing this iterator closes (cancels) the inner one now
            async for ev in stream:
                if on_event is not None:
                    r = on_event(ev)
                    if inspect.isawaitable(r):
                        await r
                yield ev

    def speculate(
        self,
        text: str | None = None,
        *,
        input_ids: Sequence[int] | None = None,
        audio: Any = None,
        audio_sample_rate: int = 16000,
        voice: str | None = None,
        sampling: Sampling | None = None,
        max_output_tokens: int | None = None,
        max_audio_frames: int | None = None,
        instructions: str | None = None,
    ) -> Speculation:
        """Start a response now with its output held back: `release()` it (its events, as if it started
        then) or `drop()` it (no event, no change to the conversation). See `omni_rt.speculation`."""
        from omni_rt.speculation import Hold, Speculation

        if self._held is not None:
            raise InvalidRequestError("a speculative response is already held: release or drop it first")
        hold = self._held = Hold(previous=self._last)
        stream = self._respond(
            text, input_ids, (audio, audio_sample_rate), voice, sampling, max_output_tokens,
            max_audio_frames, False, hold, instructions=instructions,
        )  # fmt: skip
        hold.speculation = Speculation(self, stream, hold)
        return hold.speculation

    def live_speech(self) -> LiveSpeech | None:
        """A turn to encode as it is spoken (`omni_rt.live_speech`): push its audio, then respond with
        its `clip()`; None where the engine does not (no audio encoder, or `encode_while_speaking` off)."""
        worker = self._host.speech_worker
        return None if worker is None else LiveSpeech(worker)

    async def run(self, text: str | None = None, **kwargs: Any) -> ResponseDone:
        """Drive one response to its end (events go to `on_event=`, if given); returns response.done."""
        done = None
        async for ev in self.respond(text, **kwargs):
            done = ev
        assert isinstance(done, ResponseDone)
        return done

    async def _respond(
        self,
        text,
        input_ids,
        audio,
        voice,
        sampling,
        max_output_tokens,
        max_audio_frames,
        ignore_eos,
        hold: Hold | None = None,
        instructions: str | None = None,
    ) -> AsyncIterator[Event]:
        t0 = time.perf_counter()
        rid = f"resp_{next(_response_ids)}"
        starting = _Starting()  # until it is submitted: cancel() marks it
        self._starting.add(starting)
        try:
            yield ResponseCreated(response_id=rid)
            try:
                try:  # a session used without `async with` is admitted here
                    await self._ticket.wait()
                except SessionLimitError:
                    if not self._closed:
                        raise  # else close() ended the wait: this response ends cancelled, below
                # features (and encoder tokens, if it was encoded as it was spoken) of a spoken turn
                audio, encoded = await turn_audio(*audio)
                # the last await before _build: a previous response that is still stopping can commit
                # its turn only until here, so this turn builds on the conversation as it ends up
                await self._settle_last()
                if starting.cancelled and self._closed:  # close() came while this turn was being prepared
                    yield ResponseDone(response_id=rid, status="cancelled")
                    return
                req, rate, cut = self._build(rid, t0, text, input_ids, audio, voice, sampling,
                                             max_output_tokens, max_audio_frames, ignore_eos, hold,
                                             instructions)  # fmt: skip
                if encoded is not None:  # this turn's clip is the last one; earlier ones have none
                    req.audio_encoded = [None] * (len(req.audio_features) - 1) + [encoded]
                # yielded only once this turn is submitted or over: at a yield the caller's code runs, and a
                # respond() it makes then must find this response in progress, not build a second one beside
                # it on the same slot; and a caller that leaves the loop there cancels a turn that is kept
                truncated = [] if cut is None else [ConversationTruncated(
                    response_id=rid, dropped_turns=cut.dropped_turns, dropped_tokens=cut.dropped_tokens,
                    kept_tokens=len(cut.kept), retention_ratio=retention_ratio(self.settings.truncation),
                )]  # fmt: skip
                if starting.cancelled:  # cancel() came while this turn was being prepared: no reply, but
                    if hold is None or hold.released.is_set():  # (a held speculation changes nothing)
                        self._commit(req, "cancelled")  # what the user said is the conversation all the same
                    for ev in (*truncated, ResponseDone(response_id=rid, status="cancelled")):
                        yield ev
                    return
            except OmniRtError as e:
                yield ErrorEvent.from_exception(e, rid)
                yield ResponseDone(response_id=rid, status="failed", error=ErrorEvent.from_exception(e).error)
                return
        finally:
            self._starting.discard(starting)
        resp = _Response(req, asyncio.Queue(), held=hold is not None and not hold.released.is_set())
        if hold is not None:
            hold.resp = resp
            if hold.released_at is not None:  # released while its turn was still being encoded
                resp.held_ms = (hold.released_at - t0) * 1000.0
        loop = asyncio.get_running_loop()
        bound = self._host.settings.event_queue_size

        def on_message(msg: Message) -> None:  # on the loop thread, in the pipeline's order
            terminal = isinstance(msg, ErrorOut | DoneOut)
            # held messages are bounded by the response's own limits: the caller cannot read them yet
            if not terminal and not resp.held and resp.queue.qsize() >= bound:
                self._host.fail(
                    req, CapacityError(f"the caller did not read this response's events ({bound} queued)")
                )
                return
            if isinstance(msg, DoneOut):
                if resp.held:
                    resp.deferred = msg.status  # committed if it is released, never if it is dropped
                else:
                    self._commit(req, msg.status)
                resp.status = msg.status
                resp.done.set()
            resp.queue.put_nowait(msg)

        def sink(msg: Message) -> None:  # on a stage thread
            loop.call_soon_threadsafe(on_message, msg)

        req.sink = sink
        try:
            self._host.submit(req)
        except OmniRtError as e:  # never in the pipeline: nothing for cancel() to wait for
            for ev in truncated:
                yield ev
            yield ErrorEvent.from_exception(e, rid)
            yield ResponseDone(response_id=rid, status="failed", error=ErrorEvent.from_exception(e).error)
            return
        self._current = self._last = resp
        try:
            for ev in truncated:
                yield ev
            if hold is not None:
                await hold.released.wait()
            async for ev in response_events(resp, rid, rate, t0, self._host.tokenizer, self.ids):
                yield ev
        finally:
            if not resp.done.is_set():  # the caller stopped reading: stop generating
                resp.cancel_requested = True
                self._host.cancel(req)
            if self._current is resp:
                self._current = None

    async def _settle_last(self) -> None:
        """Wait for a previous response the caller walked away from to stop (within a frame)."""
        last = self._last
        if last is not None and not last.done.is_set() and not last.cancel_requested:
            # A caller that broke out of the previous response's loop dropped its iterator; the event loop
            # closes it (and so cancels the response) in a task it has already scheduled: let it run. If it
            # has not run yet, the response is still the current one and _build refuses this turn.
            for _ in range(3):  # finalizer callback → aclose task → its first step
                await asyncio.sleep(0)
        if last is not None and last.cancel_requested and not last.done.is_set():
            await self._stop(last, "the previous response")

    async def cancel(self) -> None:
        """Barge-in: stop the current response now (within one codec frame) and keep the session.

        The response's iterator ends with `response.done(status="cancelled")`; no audio follows it.
        """
        for starting in self._starting:  # a response not submitted yet (its spoken turn's features)
            starting.cancelled = True
        resp = self._last  # also a response whose iterator the caller dropped: it may still be stopping
        if resp is not None and not resp.done.is_set():
            await self._stop(resp, "the response")

    async def _stop(self, resp: _Response, what: str) -> None:
        """Cancel `resp` in the pipeline (once) and wait until it is done; StageError if it is stuck."""
        if not resp.cancel_requested:
            resp.cancel_requested = True
            self._host.cancel(resp.req)
        try:
            await asyncio.wait_for(resp.done.wait(), timeout=STOP_TIMEOUT_S)
        except TimeoutError:
            raise StageError(f"{what} did not stop within {STOP_TIMEOUT_S:g} s") from None

    # -- internals -------------------------------------------------------------------------------------

    def _build(
        self,
        rid,
        t0,
        text,
        input_ids,
        audio,
        voice,
        sampling,
        max_output_tokens,
        max_audio_frames,
        ignore_eos,
        hold=None,
        instructions=None,
    ) -> tuple[Request, int]:
        if self._closed:
            raise InvalidRequestError("this session is closed")
        if self._held is not None and self._held is not hold:
            raise InvalidRequestError("a speculative response is held: release or drop it first")
        if not self._host.running:
            raise EngineClosedError("the engine is not running: use `async with engine:`")
        if self._current is not None and not self._current.done.is_set():
            raise InvalidRequestError("a response is already in progress in this session: cancel() it first")
        if self._caches_of != self._host.generation:  # the engine restarted: its caches are new
            if self.ids.audio in self.conversation:
                raise InvalidRequestError(
                    "this session's spoken turns were encoded into the stopped engine's caches and cannot "
                    "be prefilled again: open a new session"
                )
            self._thinker_cached = self._talker_cached = 0
            self._talker_hidden = None
            self._caches_of = self._host.generation
        if (text is None and audio is None) == (input_ids is None):
            raise InvalidRequestError("give text and/or audio, or input_ids")
        check_types(text, sampling, max_output_tokens, max_audio_frames, instructions)
        history = [] if self.conversation else self._system_turn()
        if instructions is not None:
            if input_ids is not None:
                raise InvalidRequestError(
                    "instructions go with text or audio: input_ids carry their own turns"
                )
            history += self._host.tokenizer.chat_prompt(
                [("system", instructions)], add_generation_prompt=False
            )
        if audio is not None:
            # the spoken turn: the clip's placeholders, then any text, then the assistant header
            from omni_rt.model.speech_input import speech_prompt

            count = audio_token_count(audio.shape[1], self._host.audio_window)
            text_ids = self._host.tokenizer.encode(text) if text else []
            new = speech_prompt(self.ids, [count], text_ids=text_ids, history=history)
        elif text is not None:
            if not text.strip():
                raise InvalidRequestError("empty input: text must contain something to respond to")
            new = history + self._host.tokenizer.chat_prompt([("user", text)])
        else:
            try:
                new = list(input_ids)
            except TypeError:
                raise InvalidRequestError("input_ids must be a sequence of token ids") from None
            if not new:
                raise InvalidRequestError("empty input: input_ids is empty")
            vocab = self._host.vocab_size
            if not all(isinstance(t, int | np.integer) and 0 <= t < vocab for t in new):
                raise InvalidRequestError(f"input_ids must be token ids in [0, {vocab})")
            new = [int(t) for t in new]
            if any(t in (self.ids.audio, self.ids.image, self.ids.video) for t in new):
                # a clip's encoder output fills these; a verbatim prompt brings none (send audio=...)
                raise InvalidRequestError(
                    "input_ids has audio/image/video placeholders with nothing to fill them"
                )
        if new[-3:] != [self.ids.im_start, self.ids.assistant, self.ids.newline]:
            raise InvalidRequestError(
                "the prompt must end with the assistant header [<|im_start|>, assistant, \\n] "
                f"= {[self.ids.im_start, self.ids.assistant, self.ids.newline]}"
            )
        speaker = self.speaker_id if voice is None else self._host.speaker_id(voice)
        rate = self.settings.output_sample_rate
        max_tokens = self.settings.max_output_tokens if max_output_tokens is None else int(max_output_tokens)
        max_frames = self.settings.max_audio_frames if max_audio_frames is None else int(max_audio_frames)
        if max_tokens < 1 or max_frames < 1:
            raise InvalidRequestError("max_output_tokens and max_audio_frames must be >= 1")
        # a speculative response changes nothing until it is released: one that would drop turns is not made
        cut = self._truncate(
            new, max_tokens, max_frames, dry_run=hold is not None and not hold.released.is_set()
        )
        prompt = self.conversation + close_turn(self.conversation, self.ids) + new
        s = self._host.settings
        if len(prompt) >= s.max_context:
            raise InvalidRequestError(
                f"the prompt ({len(prompt)} tokens with the conversation so far) is longer than the "
                f"context ({s.max_context} tokens)"
            )
        talker_prompt = talker_prompt_len(prompt, self.ids)
        if talker_prompt >= s.max_talker_context:
            raise InvalidRequestError(
                f"the user turns ({talker_prompt - TALKER_PROMPT_EXTRA} tokens) do not fit the Talker's "
                f"context ({s.max_talker_context})"
            )
        # the clips whose placeholders the Thinker has not prefilled: earlier turns kept without a reply
        # (or re-prefilled after a truncation), then this turn's
        thinker_start = min(self._thinker_cached, len(prompt) - 1)
        clips = (self._clips + ([] if audio is None else [audio]))[
            spoken_clips(prompt[:thinker_start], self.ids) :
        ]
        # the Talker's cache must hold its prompt plus one position per frame after the first
        max_frames = min(max_frames, s.max_talker_context - talker_prompt + 1)
        req = Request(
            id=rid,
            slot=self.slot,
            prompt_ids=prompt,
            thinker_start=thinker_start,
            talker_start=self._talker_cached,
            speaker_id=speaker,
            sampling=sampling or self.settings.sampling,
            max_output_tokens=max_tokens,
            max_audio_frames=max_frames,
            sink=lambda msg: None,
            t0=t0,
            ignore_eos=ignore_eos,
            audio_features=clips or None,
            carried_hidden=self._talker_hidden,
        )
        return req, rate, cut

    def _release_held(self, hold: Hold) -> None:
        """A speculative response becomes the response to the turn: its output flows from here."""
        hold.released.set()
        hold.released_at = time.perf_counter()
        self._held = None
        resp = hold.resp
        if resp is not None:
            resp.held = False
            resp.held_ms = (hold.released_at - resp.req.t0) * 1000.0
            if resp.deferred is not None:  # it finished while held: its turn joins the conversation now
                self._commit(resp.req, resp.deferred)

    def _forget_held(self, hold: Hold) -> None:
        """A dropped speculative response: the session is as it was before it (its turn never committed)."""
        if self._held is hold:
            self._held = None
        if hold.resp is not None and self._last is hold.resp:
            self._last = hold.previous
        if hold.resp is not None and self._current is hold.resp:
            self._current = None

    def _truncate(
        self, new: list[int], max_tokens: int, max_frames: int, dry_run: bool = False
    ) -> Truncation | None:
        """Drop the oldest turns when the conversation with `new` outgrows the input limits (room left
        for the reply in both stages' caches), as the session's `truncation` says. Applied at once: the
        dropped turns are gone whatever becomes of this response. None: nothing dropped."""
        ratio = retention_ratio(self.settings.truncation)
        s = self._host.settings
        limits = (input_limit(s.max_context, max_tokens), input_limit(s.max_talker_context, max_frames))

        def fits(conv: list[int], share: float) -> bool:
            prompt = conv + close_turn(conv, self.ids) + new
            return (
                len(prompt) <= share * limits[0] and talker_prompt_len(prompt, self.ids) <= share * limits[1]
            )

        if ratio is None or not self.conversation or fits(self.conversation, 1.0):
            return None
        if dry_run:
            raise InvalidRequestError("this turn would drop earlier turns: it is not answered speculatively")
        # down to the retention ratio; failing that, as far as the turn itself needs
        cut = truncate(self.conversation, self.ids, lambda kept: fits(kept, ratio)) or truncate(
            self.conversation, self.ids, lambda kept: fits(kept, 1.0)
        )
        if cut is None:
            head = system_head(self.conversation, self.ids)
            raise InvalidRequestError(
                f"this turn ({len(new)} tokens) does not fit the context even with every earlier turn "
                f"dropped ({limits[0] - head} tokens for it, leaving room for a reply of {max_tokens}): "
                "send a shorter one or ask for a shorter reply"
            )
        self.conversation = cut.kept
        self._clips = self._clips[cut.dropped_clips :]
        # positions after the system turn moved: both caches are valid only up to it
        self._thinker_cached = min(self._thinker_cached, cut.head)
        self._talker_cached = 0  # the Talker caches user turns only; the system turn is none
        self._talker_hidden = None  # the Thinker prefills every kept turn again, hidden states included
        return cut

    def _system_turn(self) -> list[int]:
        """The instructions as a system turn (first turn only), chat-formatted."""
        if not self.settings.instructions:
            return []
        return self._host.tokenizer.chat_prompt(
            [("system", self.settings.instructions)], add_generation_prompt=False
        )

    def _commit(self, req: Request, status: str) -> None:
        """Record the turn in the conversation (a cancelled reply is kept as far as it got; a reply
        cancelled before its first token keeps the user's turn). A failed turn is not recorded."""
        if status == "failed" or not req.tokens:
            # the stages may have written this turn into the caches: trust them only up to its start
            self._thinker_cached = min(self._thinker_cached, req.thinker_start)
            self._talker_cached = min(self._talker_cached, req.talker_start)
            if status != "failed":  # the user's turn without the assistant header nobody answered
                self._keep_clips(req)
                self.conversation = req.prompt_ids[:-3]
            return
        self._keep_clips(req)
        self.conversation = req.prompt_ids + req.tokens
        self._thinker_cached = len(self.conversation) - 1  # the last sampled token was never fed
        if req.talker_prefilled:
            self._talker_cached = count_user_tokens(req.prompt_ids, self.ids.im_start, self.ids.user)
            self._talker_hidden = None
        elif req.thinker_hidden is not None:  # a spoken turn cut before the Talker's prefill: keep its
            self._talker_hidden = req.thinker_hidden  # hidden states (and any carried) for the next turn

    def _keep_clips(self, req: Request) -> None:
        """This turn's clip, if it was spoken, joins the clips of the conversation."""
        if req.audio_features and spoken_clips(req.prompt_ids, self.ids) > len(self._clips):
            self._clips.append(req.audio_features[-1])
