"""omni_rt as a LiveKit Agents realtime model, in process: `AgentSession(llm=RealtimeModel(engine))`.

    engine = omni_rt.Engine.load("tiny")
    async with engine:
        session = AgentSession(llm=RealtimeModel(engine, voice="ethan", instructions="Be brief."))
        await session.start(agent=Agent(instructions="..."), room=ctx.room)

Each `RealtimeSession` holds one omni_rt `Session` (one cache slot of the engine). What it maps:
- `push_audio(frame)`: any rate and channel count, downmixed and resampled to 16 kHz once. With turn
  detection (the default) omni_rt's server VAD cuts turns: `input_speech_started` (and the reply being
  made is interrupted, as OpenAI's server VAD does), `input_speech_stopped`, then a reply on its own
  (`generation_created` with `user_initiated=False`; new speech also stops such a reply still waiting
  for the one before, and one whose turn an earlier reply answered is not made).
  `session(turn_detection_disabled=True)` leaves turns to the framework: `commit_audio()` ends one,
  `clear_audio()` drops it, `generate_reply()` answers.
- `generate_reply(instructions=...)`: answers the committed spoken turns and any chat items added since
  the last reply. The instructions go into the prompt as a system turn just before the user's turn,
  spoken or text.
- the generation: one `MessageGeneration` whose `audio_stream` yields `rtc.AudioFrame`s (mono int16 at
  `output_sample_rate`) and whose `text_stream` yields the transcript as the audio reaches it.
- `interrupt()`: nothing more comes out of the streams, which end at once; the engine stops the reply
  within one codec frame. `truncate(message_id, audio_end_ms=...)` shortens the assistant item in
  `chat_ctx` to what was played (the framework's `audio_transcript`, else the transcript the audio had
  reached by `audio_end_ms`). The model's own context keeps the whole reply, as `omni-rt serve` does:
  omni_rt's caches cannot be rewound (what the user said is kept either way).
- `update_instructions`: before the first reply they become the session's system turn; later, a system
  turn ahead of the next reply. `update_chat_ctx` (`livekit_chat.py`): new text messages join the next
  reply's prompt, items not heard yet follow the context handed back (removed, edited, reordered);
  removing what the model already heard is an error (`RealtimeError`). The spoken turns and replies are
  announced as `remote_item_added`, so the agent's chat context holds them. The chat context is not
  "mutable" in the framework's sense (nothing heard can be deleted): a handoff to an agent with another
  context gets a new session.
- `metrics_collected`: a `RealtimeModelMetrics` per reply; `ttft` is omni_rt's time to first audio.
- function tools (`@function_tool`, raw schemas; `livekit_tools.py`): `update_tools` / `update_options(
  tool_choice=...)` put them in the system prompt as Qwen3-Omni's chat template writes them (before the
  first reply, the session's instructions; later, a system turn ahead of the next reply). A reply's
  `<tool_call>` is an `llm.FunctionCall` on its function stream (and a remote chat item) as soon as its
  `</tool_call>` arrives; from the `<tool_call>` on nothing more of the reply is spoken or transcribed.
  The framework runs the tool and hands the `FunctionCallOutput` back through `update_chat_ctx`: it is
  the next reply's `<tool_response>` user turn. A malformed call is an `error` event and runs nothing;
  an output for a call the model did not make, or a second one, is a `RealtimeError`. A reply's own
  tools or tool choice are not supported (`per_response_tool_choice=False`: the framework sets them on
  the session).
- the user's transcript (`user_transcription=True`, the default, as OpenAI's plugin transcribes by default;
  `omni_rt.transcribe`): each spoken turn, once committed, is transcribed by the Thinker in a short-lived
  session of its own (one engine slot while it runs), never before the reply that answers it has its
  first audio (or ended): `input_audio_transcription_completed` with the text so far as it comes
  (`is_final=False`), then `llm.InputTranscriptionCompleted(item_id=<the user item announced>,
  is_final=True)`, so `AgentSession` fires `user_input_transcribed` and the agent's chat context holds the
  text. A turn no reply answers yet waits for the next reply. A transcription that cannot run (no free
  session slot, the engine stopped) is an `error` event (recoverable); the conversation goes on.
Not supported (a `RealtimeError`, or an `error` event for the streaming calls): video input, `say`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, Literal

import numpy as np
from livekit import rtc
from livekit.agents import llm
from livekit.agents.types import NOT_GIVEN, NotGivenOr
from livekit.agents.utils import is_given

from omni_rt.audio.vad import SpeechStarted, SpeechStopped, Turn, TurnSegmenter, VadConfig
from omni_rt.config import Sampling
from omni_rt.errors import OmniRtError
from omni_rt.integrations import _engine as shared_engine
from omni_rt.integrations._audio import SPEECH_RATE, InputAudio, TurnBuffer
from omni_rt.integrations._prompt import reply_prompt, system_turn, users_words
from omni_rt.integrations.livekit_chat import update_chat_ctx
from omni_rt.integrations.livekit_generation import Generation, created_event, reply_metrics
from omni_rt.integrations.livekit_tools import SessionTools
from omni_rt.tools import BadToolCall
from omni_rt.transcribe import Transcriber, Transcript

__all__ = ["RealtimeModel", "RealtimeSession"]

KEPT_GENERATIONS = 64  # replies truncate() can still shorten, newest kept


class RealtimeModel(llm.RealtimeModel):
    """A LiveKit realtime model backed by an in-process `omni_rt.Engine`.

    The engine may be running already (`async with engine:`); if not, the first session starts it and
    `aclose()` lets go of it: the last model (or pipecat pipeline) using it stops it.
    """

    def __init__(
        self,
        engine: Any,
        *,
        voice: str = "ethan",
        instructions: str | None = None,
        sampling: Sampling | None = None,
        output_sample_rate: int = 24000,
        vad: VadConfig | None = None,
        max_output_tokens: int | None = None,
        max_audio_frames: int | None = None,
        ignore_eos: bool = False,
        user_transcription: bool = True,
    ) -> None:
        super().__init__(
            capabilities=llm.RealtimeCapabilities(
                message_truncation=True,
                turn_detection=True,
                user_transcription=user_transcription,  # the Thinker's own, after the reply's first audio
                # the framework runs the tools, hands back their outputs and asks for the reply
                auto_tool_reply_generation=False,
                audio_output=True,
                # a call in a chat context that this session's model did not make cannot be resumed
                manual_function_calls=False,
                can_disable_turn_detection=True,
                # new items can be added, but nothing the model heard can be deleted or edited: told so,
                # the framework opens a new session for an agent with another context (a handoff) rather
                # than asking this one to forget
                mutable_chat_context=False,
                mutable_instructions=True,
                mutable_tools=True,  # new tools: a new system turn before the next reply
            )
        )
        self.engine = engine
        self.vad = vad
        self.user_transcription = user_transcription
        self._session_kwargs = dict(
            voice=voice, instructions=instructions, sampling=sampling, output_sample_rate=output_sample_rate
        )
        self._respond_kwargs = dict(
            max_output_tokens=max_output_tokens, max_audio_frames=max_audio_frames, ignore_eos=ignore_eos
        )
        self._starting = asyncio.Lock()
        self._owns_engine = False

    @property
    def model(self) -> str:
        return str(getattr(self.engine, "name", "omni_rt"))

    @property
    def provider(self) -> str:
        return "omni_rt"

    def session(self, *, turn_detection_disabled: bool = False) -> RealtimeSession:
        return RealtimeSession(self, detect=not turn_detection_disabled)

    async def aclose(self) -> None:
        if self._owns_engine:
            self._owns_engine = False
            await shared_engine.release(self.engine)

    async def _open(self, instructions: str | None) -> Any:
        """An omni_rt session, the engine started first when nobody has."""
        async with self._starting:
            if not self._owns_engine:
                self._owns_engine = await shared_engine.use(self.engine)
        return self.engine.session(**(self._session_kwargs | {"instructions": instructions}))


class RealtimeSession(llm.RealtimeSession):
    def __init__(self, model: RealtimeModel, *, detect: bool = True) -> None:
        super().__init__(model)
        self._model = model
        self._input = InputAudio()
        self._segmenter = TurnSegmenter(model.vad) if detect else None
        self._buffer = None if detect else TurnBuffer(preroll_ms=0, always_open=True)
        self._instructions: str | None = model._session_kwargs["instructions"]
        self._tools = SessionTools()
        self._committed: list[np.ndarray] = []  # spoken turns the next reply answers
        # chat items the model has not heard yet, by item id, in the chat context's order: (role, text) the
        # next reply's prompt carries
        self._pending: dict[str, tuple[str, str]] = {}
        self._refused: list[tuple[str, str]] = []  # the user's words a refused reply kept (`users_words`)
        self._chat_ctx = llm.ChatContext.empty()
        self._lock = asyncio.Lock()  # one reply at a time, in the order asked
        self._current: Generation | None = None
        # replies to turns omni_rt's VAD ended, waiting for the one being made: to OpenAI's server VAD they
        # are made already, so an interruption stops them too (the speech they answer waits for the next)
        self._waiting: set[Generation] = set()
        self._generations: dict[str, Generation] = {}  # the latest replies, by message id (truncate)
        self._tasks: set[asyncio.Task] = set()
        self._owed: set[asyncio.Future] = set()  # generate_reply futures not resolved yet
        self._closed = False
        self._session: Any = None
        self._opening = asyncio.ensure_future(model._open(self._instructions))
        self._video_refused = False
        self._transcriber = (
            Transcriber(model.engine, lambda coro, _name: self._spawn(coro), on_done=self._transcribed,
                        on_delta=self._transcribing)
            if model.user_transcription else None
        )  # fmt: skip
        self._transcripts: dict[str, str] = {}  # the text so far of the turn being transcribed, by item id

    # -- state -----------------------------------------------------------------------------------------

    @property
    def chat_ctx(self) -> llm.ChatContext:
        return self._chat_ctx.copy()

    @property
    def tools(self) -> llm.ToolContext:
        return self._tools.context.copy()

    @property
    def omni_session(self) -> Any:
        """The omni_rt `Session` behind this one (None until it is open)."""
        return self._session

    async def _ready(self) -> Any:
        opening = self._opening
        if self._session is None and opening.done() and not opening.cancelled() and opening.exception():
            # that open failed (no free slot, ...) and its error went to the reply that met it: try again
            self._opening = asyncio.ensure_future(
                self._model._open(self._tools.system_prompt(self._instructions) or None)
            )
        if self._session is None:
            self._session = await self._opening
        return self._session

    async def update_instructions(self, instructions: str) -> None:
        self._instructions = instructions  # the next reply says them (`_system_turn`)

    async def update_chat_ctx(self, chat_ctx: llm.ChatContext) -> None:
        # no await: a reply under way takes the new items or leaves them for the next, never half
        self._pending = update_chat_ctx(self._chat_ctx, self._pending, self._tools, chat_ctx)

    async def update_tools(self, tools: list[Any]) -> None:
        self._tools.update(tools)  # the next reply says them (`_system_turn`)

    def update_options(self, *, tool_choice: NotGivenOr[Any] = NOT_GIVEN) -> None:
        if is_given(tool_choice):
            self._tools.set_choice(tool_choice)

    # -- input audio -----------------------------------------------------------------------------------

    def push_audio(self, frame: rtc.AudioFrame) -> None:
        pcm = self._input.push(bytes(frame.data), frame.sample_rate, frame.num_channels)
        if self._buffer is not None:
            self._buffer.push(pcm)
            return
        for ev in self._segmenter.push(pcm):
            if isinstance(ev, SpeechStarted):
                self.emit("input_speech_started", llm.InputSpeechStartedEvent())
                self.interrupt()  # the user talks over the reply: stop it, as server VAD does
            elif isinstance(ev, SpeechStopped):
                self.emit(
                    "input_speech_stopped",
                    llm.InputSpeechStoppedEvent(user_transcription_enabled=self._transcriber is not None),
                )
            elif isinstance(ev, Turn):
                self._commit(ev.audio)
                gen = Generation()
                self._waiting.add(gen)
                self._spawn(self._reply(gen, None, user_initiated=False, instructions=None))

    def push_video(self, frame: rtc.VideoFrame) -> None:
        if not self._video_refused:
            self._video_refused = True
            self._error(llm.RealtimeError("omni_rt takes no video input: video frames are dropped"))

    def commit_audio(self) -> None:
        audio = self._buffer.take() if self._buffer is not None else _turn_audio(self._segmenter.commit())
        if audio is None:
            self._error(llm.RealtimeError("commit_audio: the input audio buffer is empty"))
            return
        self._commit(audio)

    def clear_audio(self) -> None:
        if self._buffer is not None:
            self._buffer.clear()
        else:
            self._segmenter.clear()

    def _commit(self, audio: np.ndarray) -> None:
        self._committed.append(audio)
        pcm = (np.clip(audio, -1.0, 1.0) * 32767.0).astype(np.int16)
        frame = rtc.AudioFrame(pcm.tobytes(), SPEECH_RATE, 1, len(pcm))
        item = llm.ChatMessage(role="user", content=[llm.AudioContent(frame=[frame])])
        self._add_item(item)
        if self._transcriber is not None:
            self._transcriber.add(item.id, audio)
        self._gate()

    # -- the user's transcript -------------------------------------------------------------------------

    def _gate(self) -> None:
        """Transcripts wait while speech is committed that no reply has taken yet, and while a reply is
        getting under way (until its first audio, or its end): they never delay the answer."""
        if self._transcriber is None:
            return
        gen = self._current
        starting = gen is not None and not gen.done.is_set() and gen.samples == 0
        if self._committed or starting:
            self._transcriber.hold()
        else:
            self._transcriber.release()

    async def _transcribing(self, item_id: str, delta: str) -> None:
        text = self._transcripts[item_id] = self._transcripts.get(item_id, "") + delta
        self.emit(
            "input_audio_transcription_completed",
            llm.InputTranscriptionCompleted(item_id=item_id, transcript=text, is_final=False),
        )

    async def _transcribed(self, t: Transcript) -> None:
        """The turn's transcript, as OpenAI's plugin hands over the server's: the user item gets the text and
        the framework its final `InputTranscriptionCompleted` (it replaces the agent's item by id)."""
        self._transcripts.pop(t.item_id, None)
        if t.error is not None:
            code, message = t.error
            self._error(
                llm.RealtimeError(
                    f"omni_rt could not transcribe the user's turn {t.item_id} ({code}): {message}"
                )
            )
            return
        item = self._chat_ctx.get_by_id(t.item_id)
        if item is not None and t.text:
            item.content.append(t.text)
        self.emit(
            "input_audio_transcription_completed",
            llm.InputTranscriptionCompleted(
                item_id=t.item_id, transcript=t.text, is_final=True,
                # when the turn's audio began: the framework dates the message by it, before its reply
                turn_started_at=item.created_at - t.seconds if item is not None else None,
            ),
        )  # fmt: skip

    def _add_item(self, item: llm.ChatMessage) -> None:
        """An item the model made or heard on its own, announced as OpenAI's plugin announces the server's:
        the framework then keeps it in the agent's chat context, which it hands back to update_chat_ctx."""
        previous = self._chat_ctx.items[-1].id if self._chat_ctx.items else None
        self._chat_ctx.insert(item)
        self.emit("remote_item_added", llm.RemoteItemAddedEvent(previous_item_id=previous, item=item))

    # -- replies ---------------------------------------------------------------------------------------

    def generate_reply(
        self,
        *,
        instructions: NotGivenOr[str] = NOT_GIVEN,
        tool_choice: NotGivenOr[Any] = NOT_GIVEN,
        tools: NotGivenOr[list[Any]] = NOT_GIVEN,
    ) -> asyncio.Future[llm.GenerationCreatedEvent]:
        fut: asyncio.Future[llm.GenerationCreatedEvent] = asyncio.get_running_loop().create_future()
        # the tools are in the system prompt, which one reply cannot change and change back (the capability
        # per_response_tool_choice is False: the framework sets them on the session instead)
        if (is_given(tools) and llm.ToolContext(tools) != self._tools.context) or (
            is_given(tool_choice) and tool_choice != self._tools.choice
        ):
            fut.set_exception(
                llm.RealtimeError(
                    "omni_rt: a reply's own tools or tool_choice: use update_tools / update_options"
                )
            )
            return fut
        if self._closed:
            fut.set_exception(llm.RealtimeError("generate_reply: the realtime session is closed"))
            return fut
        gen = Generation()
        self._owed.add(fut)
        fut.add_done_callback(self._owed.discard)
        # the framework cancels the future of a reply interrupted before it came (OpenAI's plugin then
        # cancels the response): it is dropped, and the next reply does not wait behind it
        fut.add_done_callback(lambda f: self._stop(gen) if f.cancelled() else None)
        self._spawn(self._reply(gen, fut, user_initiated=True, instructions=instructions or None))
        return fut

    def interrupt(self) -> None:
        """Stop the reply now: its streams end at once and carry nothing more; the engine stops it."""
        for gen in [*self._waiting, *([] if self._current is None else [self._current])]:
            self._stop(gen)

    def _stop(self, gen: Generation) -> None:
        """Stop one reply, made or not yet made (then it never is)."""
        if gen.done.is_set() or gen.interrupted:
            return
        gen.interrupted = True
        gen.close()
        if gen is self._current and self._session is not None:
            self._spawn(self._session.cancel())

    def truncate(
        self,
        *,
        message_id: str,
        modalities: list[Literal["text", "audio"]],
        audio_end_ms: int,
        audio_transcript: NotGivenOr[str] = NOT_GIVEN,
    ) -> None:
        item = self._chat_ctx.get_by_id(message_id)
        gen = self._generations.get(message_id)
        if item is None or gen is None:
            self._error(llm.RealtimeError(f"truncate: no assistant message {message_id!r}"))
            return
        played_ms = gen.samples * 1000 / self._model._session_kwargs["output_sample_rate"]
        if audio_end_ms < 0 or audio_end_ms > played_ms + 1:  # + 1: the caller's rounding
            self._error(
                llm.RealtimeError(
                    f"truncate: audio_end_ms {audio_end_ms} is outside the message's audio "
                    f"(0..{played_ms:.0f} ms)"
                )  # fmt: skip
            )
            return
        gen.truncated = (
            audio_transcript if isinstance(audio_transcript, str) else gen.transcript(audio_end_ms)
        )
        item.content = [gen.truncated]
        item.interrupted = True

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.interrupt()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for fut in list(self._owed):  # a reply task cancelled before it ran never resolves its own
            if not fut.done():
                fut.set_exception(llm.RealtimeError("generate_reply: the realtime session is closed"))
        with contextlib.suppress(Exception):  # a session that never opened has nothing to close
            session = self._session or await self._opening  # (never a new one, as _ready opens)
            await session.close()

    def _spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _error(self, exc: Exception, recoverable: bool = True) -> None:
        self.emit(
            "error",
            llm.RealtimeModelError(
                timestamp=time.time(), label=self._model.label, error=exc, recoverable=recoverable
            ),
        )

    async def _system_turn(self) -> tuple[Any, list[tuple[str, str]]]:
        """The omni_rt session for the next reply, and the system turn it starts with: the system prompt
        (instructions, tools) where it changed since the model last heard it. Before anything was said the
        session is opened anew with it, as its own instructions (its first turn says them)."""
        session = await self._ready()
        system = self._tools.system_prompt(self._instructions)
        turn = system_turn(session, self._model.engine.tokenizer, system)
        if turn is None:
            await session.close()
            self._session = None
            self._opening = asyncio.ensure_future(self._model._open(system or None))
            return await self._ready(), []
        return session, turn

    def _take(self) -> tuple[np.ndarray | None, dict[str, tuple[str, str]]]:
        """What the next reply answers: the committed speech (one spoken turn) and the pending chat items."""
        audio = np.concatenate(self._committed) if self._committed else None
        pending, self._pending, self._committed = self._pending, {}, []
        return audio, pending

    async def _reply(
        self, gen: Generation, fut: asyncio.Future | None, *, user_initiated: bool, instructions: str | None
    ) -> None:
        try:
            async with self._lock:
                self._waiting.discard(gen)
                if gen.interrupted or (fut is not None and fut.cancelled()):
                    return  # dropped before its turn came: what it would have answered waits for the next
                if fut is None and not self._committed and not self._pending:
                    return  # its turn was answered by a reply before it: no reply to nothing
                session, system = await self._system_turn()
                self._current = gen
                audio, pending = self._take()
                prompt = reply_prompt(
                    session, self._model.engine.tokenizer,
                    system + ([("system", instructions)] if instructions else []) + [*pending.values()], audio,
                )  # fmt: skip
                try:
                    done = await self._stream(session, gen, fut, user_initiated, prompt)
                finally:
                    gen.close()
                    gen.done.set()
                    self._gate()
                if done is not None and done.status == "failed":  # never recorded: the model heard none of it
                    self._committed[:0] = [] if audio is None else [audio]
                    self._gate()
                    self._refused = users_words([*pending.values()], self._refused)
                    kept = {i: t for i, t in pending.items() if any(t is r for r in self._refused)}
                    self._pending = kept | self._pending  # the next reply's, first (their items come first)
        except Exception as e:  # the caller's future or an error event: never a reply that silently hangs
            known = isinstance(e, OmniRtError | llm.RealtimeError)
            if fut is not None and not fut.done():
                fut.set_exception(e if isinstance(e, llm.RealtimeError) else llm.RealtimeError(str(e)))
            else:
                self._error(e, recoverable=known)
            if not known:
                raise

    async def _stream(self, session, gen: Generation, fut, user_initiated: bool, prompt: dict) -> Any:
        """Run one reply; its response.done (None if it never came)."""
        t_created = time.time()
        item = done = None
        calls = self._tools.parser()  # None: no tools offered
        async for ev in session.respond(**prompt, **self._model._respond_kwargs):
            if ev.type == "response.created":
                gen.response_id = ev.response_id
                if gen.interrupted:  # interrupted before the engine had it
                    await session.cancel()
                if fut is not None and fut.cancelled():
                    continue  # dropped by the framework: nobody takes this generation
                item = llm.ChatMessage(id=gen.message_id, role="assistant", content=[])
                self._generations[gen.message_id] = gen  # what truncate() needs to know about it
                while len(self._generations) > KEPT_GENERATIONS:
                    self._generations.pop(next(iter(self._generations)))
                self._add_item(item)
                created = created_event(gen, user_initiated)
                self.emit("generation_created", created)
                if fut is not None and not fut.done():
                    fut.set_result(created)
            elif ev.type == "response.done":
                done = ev
                if calls is not None and not gen.interrupted and ev.status != "cancelled":
                    for bad in calls.end():  # a call left open by the model, not one cut by a stop
                        self._bad_call(bad)
                gen.close()
                if item is not None:
                    item.content = [gen.truncated if gen.truncated is not None else gen.transcript()]
                    item.interrupted = ev.status == "cancelled" or gen.truncated is not None
                self.emit("metrics_collected", reply_metrics(ev, t_created, self._model))
                if ev.status == "failed":
                    msg = ev.error.message if ev.error is not None else "the response failed"
                    if fut is not None and not fut.done():
                        fut.set_exception(llm.RealtimeError(msg))
                    else:
                        self._error(llm.RealtimeError(msg))
            elif gen.interrupted:
                continue  # the engine is stopping it: nothing more goes out
            elif ev.type == "response.output_text.delta":
                for call in calls.feed(ev.delta, ev.token_ids)[1] if calls is not None else []:
                    if isinstance(call, BadToolCall):
                        self._bad_call(call)
                    else:
                        self._function_call(gen, self._tools.made(call))
            elif calls is not None and calls.calling:
                continue  # from a <tool_call> on nothing more of the reply is spoken
            elif ev.type == "response.output_audio.delta":
                gen.audio.send_nowait(rtc.AudioFrame(ev.pcm.tobytes(), ev.sample_rate, 1, len(ev.pcm)))
                gen.samples += len(ev.pcm)
                if gen.samples == len(ev.pcm):  # its first audio: the transcripts may run
                    self._gate()
            elif ev.type == "response.output_audio_transcript.delta":
                gen.transcript_deltas.append(ev.delta)
                gen.text.send_nowait(ev.delta)
        return done

    def _function_call(self, gen: Generation, call: llm.FunctionCall) -> None:
        """A call the model made: in the chat context (announced, as OpenAI's plugin announces the server's
        function_call item), and on the generation's function stream, for the framework to run."""
        self._add_item(call)
        gen.functions.send_nowait(call)

    def _bad_call(self, bad: BadToolCall) -> None:
        """A malformed call (not JSON, an unknown tool, left open): nothing is run; the reply says nothing
        more, as with a good one, and the error says why."""
        self._error(llm.RealtimeError(f"omni_rt: the model made a malformed tool call: {bad.message}"))


def _turn_audio(turn: Turn | None) -> np.ndarray | None:
    return None if turn is None or not len(turn.audio) else turn.audio
