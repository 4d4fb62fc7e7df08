"""omni_rt as a pipecat speech-to-speech service, in process: no second server, no audio over a socket.

    engine = omni_rt.Engine.load("tiny")
    omni = OmniRtService(engine, voice="ethan", instructions="Be brief.")
    turns = UserTurnStrategies(stop=[TurnAnalyzerUserTurnStopStrategy(
        turn_analyzer=LocalSmartTurnAnalyzerV3(), wait_for_transcript=False)])  # no STT: audio decides
    pipeline = Pipeline([transport.input(), VADProcessor(vad_analyzer=SileroVADAnalyzer()),
                         UserTurnProcessor(user_turn_strategies=turns), omni, transport.output()])

In: `InputAudioRawFrame` at any rate and channel count (downmixed and resampled to 16 kHz once), and the
framework's turn frames. Text: `LLMMessagesAppendFrame`'s text messages join the next reply's prompt (as
text after the speech when the reply answers a spoken turn), `run_llm` or an `LLMRunFrame` starts that
reply; `LLMUpdateSettingsFrame`'s `system_instruction` (the system turn, or a system turn ahead of the next
reply once something was said) and `max_tokens`. `LLMContextFrame`s pass through unread (the conversation
lives in the omni_rt session), but the first starts the conversation when nothing was said yet (a context
aggregator in front turns the app's `LLMRunFrame` into one); `LLMMessagesUpdateFrame` and video (the first
`InputImageRawFrame`) are `ErrorFrame`s upstream. With `turn_detection="pipecat"`
(the default) pipecat's VAD and turn analyzer drive turns: `UserStartedSpeakingFrame` opens a turn (with
the last `preroll_ms` of audio as its lead-in), `UserStoppedSpeakingFrame` sends it to the model,
`InterruptionFrame` stops the reply. With
`turn_detection="omni_rt"` the service cuts turns itself with omni_rt's server VAD and broadcasts the
same user-turn frames and the interruption, as pipecat's own realtime services do.

Out, per reply: `LLMFullResponseStartFrame`, `TTSStartedFrame`, `TTSAudioRawFrame`s (mono int16 at the
pipeline's output rate when the session can make it: 16, 24 or 48 kHz, else 24 kHz for the transport to
resample), `LLMTextFrame`s (the model's text as it is sampled; not appended to the context),
`TTSTextFrame`s (the text the audio has reached), `TTSStoppedFrame`, `LLMFullResponseEndFrame`; metrics
frames (TTFB = time to the first audio, TTFA = to the first audible sample, processing time, token usage)
when the pipeline enables metrics.

Function calling is pipecat's own (the service is an `LLMService`; `pipecat_tools.py`): the tools of
`LLMSetToolsFrame` or of the context (its `tool_choice` too) go into the system prompt as Qwen3-Omni's chat
template writes them (before anything is said, the session's instructions; later a system turn ahead of the
next reply). A reply's `<tool_call>` runs through `run_function_calls` (the handlers given to
`register_function`, or carried by the tools) as soon as its `</tool_call>` arrives; from `<tool_call>` on
nothing more of the reply is spoken or shown. The final result (`FunctionCallResultFrame`, as JSON) is the
next reply's `<tool_response>` user turn (a call pipecat cancels, "CANCELLED"); that reply is made when
the assistant context aggregator asks for it (its `LLMContextFrame` upstream: a result, or a call past its
`timeout_secs`), as with pipecat's OpenAI realtime service. A malformed call is an `ErrorFrame` and runs
nothing.

The user's transcript (`user_transcription=True`; off by default: it arrives while the reply plays, and
pipecat's default user-turn start strategies, `TranscriptionUserTurnStartStrategy` in a `UserTurnProcessor`,
take a transcript then for a barge-in; the context aggregator pair in realtime mode drops that strategy
itself; `omni_rt.transcribe`): each spoken turn is
transcribed by the Thinker in a short-lived session of its own (one engine slot while it runs), started
at the first audio of the reply that answers it (or at its end), never before. Its text goes upstream, as
pipecat's speech-to-speech services send theirs, to the user context aggregator: `InterimTranscriptionFrame`s
(the text so far), then one `TranscriptionFrame` (`user_id`, `timestamp`, `finalized`; `result` is the
`omni_rt.transcribe.Transcript`). The reply's `LLMFullResponseEndFrame` waits for it (not for an
interrupted reply), so the aggregator writes the user's message ahead of the reply's. A transcription that
cannot run (no free session slot, the engine stopped) is a non-fatal `ErrorFrame`; the reply is unaffected.

An `InterruptionFrame` cancels the reply before the service passes the frame on: the engine stops it
within one codec frame, and no audio of it is pushed after, so nothing of it is queued behind the
interruption that the output transport clears. A `CancelFrame` stops the reply the same way and gives the
session back to the engine; so does the pipeline's cleanup, however the pipeline ended (pipecat sends no
`CancelFrame` into a pipeline that has not started yet), and no reply task outlives it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from loguru import logger
from pipecat.frames.frames import (
    CancelFrame,
    EndFrame,
    Frame,
    FunctionCallCancelFrame,
    FunctionCallResultFrame,
    InputAudioRawFrame,
    InputImageRawFrame,
    InterimTranscriptionFrame,
    InterruptionFrame,
    LLMContextFrame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    LLMMessagesAppendFrame,
    LLMMessagesUpdateFrame,
    LLMRunFrame,
    LLMServiceMetadataFrame,
    LLMSetToolsFrame,
    LLMTextFrame,
    LLMUpdateSettingsFrame,
    TranscriptionFrame,
    TTSAudioRawFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
    TTSTextFrame,
    UserStartedSpeakingFrame,
    UserStoppedSpeakingFrame,
)
from pipecat.metrics.metrics import LLMTokenUsage
from pipecat.processors.aggregators.llm_context import standard_message_text
from pipecat.processors.frame_processor import FrameDirection, FrameProcessorSetup
from pipecat.services.llm_service import LLMService
from pipecat.services.settings import LLMSettings, is_given
from pipecat.turns.user_turn_strategies import ExternalUserTurnStrategies
from pipecat.utils.text.base_text_aggregator import TextType
from pipecat.utils.time import time_now_iso8601

from omni_rt.audio.vad import SpeechStarted, Turn, TurnSegmenter, VadConfig
from omni_rt.config import OUTPUT_SAMPLE_RATES, Sampling
from omni_rt.errors import ConfigError, OmniRtError
from omni_rt.integrations import _engine as shared_engine
from omni_rt.integrations._audio import InputAudio, TurnBuffer
from omni_rt.integrations._prompt import ROLES, reply_prompt, system_turn, users_words
from omni_rt.integrations.pipecat_tools import ToolCalls
from omni_rt.tools import BadToolCall
from omni_rt.transcribe import Transcriber, Transcript

__all__ = ["OmniRtService"]


@dataclass(eq=False)
class _Reply:
    turns: list[np.ndarray]  # the spoken turns it answers (16 kHz mono), in order: one, or none
    messages: list[tuple[str, str]]  # (role, text) added since the last reply, after the speech
    task: asyncio.Task | None = None  # held here: a task nobody references can be collected mid-run
    response_id: str | None = None
    interrupted: bool = False  # set first thing on an interruption: nothing of it is pushed after
    ran: bool = False  # sent to the engine (else an interruption dropped it first)
    started: bool = False  # TTSStartedFrame pushed
    done: asyncio.Event = field(default_factory=asyncio.Event)  # set when its task ends, however it ends
    cut: asyncio.Event = field(default_factory=asyncio.Event)  # set with `interrupted`
    transcripts: list[asyncio.Future] | None = None  # its turns' transcriptions, once started

    @property
    def audio(self) -> np.ndarray | None:
        return np.concatenate(self.turns) if self.turns else None


class OmniRtService(LLMService):
    """A pipecat speech-to-speech service backed by an in-process `omni_rt.Engine` (one session).

    The engine may be started already (`async with engine:`); if it is not, the service starts it at the
    pipeline's start, and the last pipeline (or LiveKit model) using it stops it at its end.
    """

    def __init__(
        self,
        engine: Any,
        *,
        voice: str = "ethan",
        instructions: str | None = None,
        sampling: Sampling | None = None,
        turn_detection: Literal["pipecat", "omni_rt"] = "pipecat",
        vad: VadConfig | None = None,
        preroll_ms: int = 500,
        max_output_tokens: int | None = None,
        max_audio_frames: int | None = None,
        ignore_eos: bool = False,
        user_transcription: bool = False,
        user_id: str = "",
        **kwargs: Any,
    ) -> None:
        if turn_detection not in ("pipecat", "omni_rt"):
            raise ConfigError(f"turn_detection must be 'pipecat' or 'omni_rt', got {turn_detection!r}")
        # an LLMService: pipecat's function calling (register_function, the context's tools) is its
        # every field set (pipecat logs an error at start for one left NOT_GIVEN); None: not a setting here
        unset = dict.fromkeys(
            ("temperature", "top_p", "top_k", "frequency_penalty", "presence_penalty", "seed",
             "filter_incomplete_user_turns", "user_turn_completion_config"),
        )  # fmt: skip
        settings = LLMSettings(
            model=getattr(engine, "name", "omni_rt"), system_instruction=instructions,
            max_tokens=max_output_tokens, **unset,
        )  # fmt: skip
        super().__init__(settings=settings, **kwargs)
        self.engine = engine
        self.turn_detection = turn_detection
        self._session_kwargs = dict(voice=voice, instructions=instructions, sampling=sampling)
        self._instructions = instructions
        self._tools = ToolCalls(self)
        self._respond_kwargs = dict(
            max_output_tokens=max_output_tokens, max_audio_frames=max_audio_frames, ignore_eos=ignore_eos
        )
        self._input = InputAudio()
        self._turn = TurnBuffer(preroll_ms=preroll_ms)
        self._segmenter = TurnSegmenter(vad) if turn_detection == "omni_rt" else None
        self._out_rate = 24000
        self._session: Any = None
        self._ended = False  # the pipeline ended: its session is closed for good
        self._owns_engine = False
        self._replies: list[_Reply] = []  # replies not done yet: the running one, then those waiting
        self._messages: list[tuple[str, str]] = []  # (role, text) the next reply's prompt carries
        self._video_refused = False
        self._context_seen = False  # the first LLMContextFrame may start the conversation; later ones not
        self._unheard: list[np.ndarray] = []  # turns of dropped replies: the next reply answers them first
        self._refused: list[tuple[str, str]] = []  # the user's words a refused reply kept (`users_words`)
        self.user_transcription = user_transcription
        self.user_id = user_id  # on its TranscriptionFrames
        self._transcriber = (
            Transcriber(engine, self._spawn_transcription, on_done=self._transcribed, on_delta=self._transcribing)
            if user_transcription else None
        )  # fmt: skip
        self._transcription_task: asyncio.Task | None = None
        self._transcripts: dict[str, str] = {}  # the text so far of the turn being transcribed, by its id
        self._turn_ids = 0
        # on_response_done(service, ev): each reply's omni_rt `response.done` (status, usage, metrics)
        self._register_event_handler("on_response_done")

    def can_generate_metrics(self) -> bool:
        return True

    def service_metadata_frame(self) -> LLMServiceMetadataFrame:
        """A realtime service: pipecat's context aggregator then ends turns without waiting for a transcript;
        with omni_rt's VAD the service's own turn frames are the ones to follow."""
        return LLMServiceMetadataFrame(
            service_name=self.name,
            is_realtime_service=True,
            user_turn_strategies=ExternalUserTurnStrategies() if self._segmenter is not None else None,
        )

    @property
    def session(self) -> Any:
        """The omni_rt `Session` of this pipeline (None before the pipeline starts)."""
        return self._session

    # -- lifecycle -------------------------------------------------------------------------------------

    async def setup(self, setup: FrameProcessorSetup) -> None:
        await super().setup(setup)
        rate = setup.audio_out_sample_rate
        self._out_rate = rate if rate in OUTPUT_SAMPLE_RATES else 24000  # else the transport resamples

    async def start(self, frame: Frame) -> None:
        await super().start(frame)
        self._owns_engine = await shared_engine.use(self.engine)
        try:
            self._session = self.engine.session(output_sample_rate=self._out_rate, **self._session_kwargs)
        except OmniRtError:  # no free slot now: the first reply opens it, or says why it cannot
            logger.warning(f"{self}: the omni_rt session did not open at the start; the first reply opens it")

    async def stop(self, frame: EndFrame) -> None:
        """At the pipeline's end a reply still being made is finished, as everything queued before it is."""
        await super().stop(frame)
        for reply in list(self._replies):
            await reply.done.wait()
        await self._close()

    async def cancel(self, frame: CancelFrame) -> None:
        await super().cancel(frame)
        try:
            await self._interrupt()
        finally:  # the session goes back even if the engine did not stop the reply
            await self._close()

    async def cleanup(self) -> None:
        """However the pipeline ended: pipecat sends no CancelFrame into a pipeline that had not started
        yet, and the reply tasks are this service's own, so no reply outlives the pipeline and the session
        goes back to the engine here too."""
        try:
            for reply in self._replies:
                if reply.task is not None:
                    await self.cancel_task(reply.task)
            self._replies = []
            if self._transcription_task is not None:
                await self.cancel_task(self._transcription_task)
            await self._close()
        finally:
            await super().cleanup()

    async def _close(self) -> None:
        self._ended = True  # no reply opens a session any more
        session, self._session = self._session, None  # taken first: a cleanup during a cancel closes it once
        try:
            if session is not None:
                await session.close()
        finally:
            if self._owns_engine:
                self._owns_engine = False
                await shared_engine.release(self.engine)

    # -- frames ----------------------------------------------------------------------------------------

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        if isinstance(frame, InterruptionFrame):
            # before the base class stops all metrics: an unanswered TTFB is no measurement
            await self.cancel_ttfb_metrics()
            await self._interrupt()
        await super().process_frame(frame, direction)
        if isinstance(frame, InputAudioRawFrame):
            await self._on_audio(frame)
        elif self.turn_detection == "pipecat" and isinstance(frame, UserStartedSpeakingFrame):
            self._turn.start()
        elif self.turn_detection == "pipecat" and isinstance(frame, UserStoppedSpeakingFrame):
            audio = self._turn.take()
            if audio is not None:
                self._respond(audio)
        elif isinstance(frame, LLMMessagesAppendFrame):
            if await self._append(frame.messages) and frame.run_llm:
                self._respond(None)
        elif isinstance(frame, LLMRunFrame):
            self._respond(None)
        elif isinstance(frame, LLMContextFrame):
            await self._on_context(frame, direction)
        elif isinstance(frame, LLMUpdateSettingsFrame) and frame.service not in (None, self):
            return  # another service's: LLMService passed it on
        elif isinstance(frame, LLMMessagesUpdateFrame):
            await self.push_error(
                "omni_rt cannot replace the conversation the model has heard (its caches cannot be "
                "rewound): LLMMessagesUpdateFrame is ignored; add messages with LLMMessagesAppendFrame"
            )
        elif isinstance(frame, LLMSetToolsFrame):
            # a continuous session gets no context frame per turn: the handlers follow the tools here too
            self._sync_registered_tool_handlers(frame.tools)
            await self._tools.set_tools(frame.tools)
        elif isinstance(frame, InputImageRawFrame) and not self._video_refused:
            self._video_refused = True  # said once: a camera sends many
            await self.push_error("omni_rt takes no video input: image frames pass through unread")
        await self.push_frame(frame, direction)

    async def _on_context(self, frame: LLMContextFrame, direction: FrameDirection) -> None:
        """A context aggregator in front turns the app's LLMRunFrame (or an LLMMessagesAppendFrame that asks
        to run) into LLMContextFrames. As pipecat's own realtime services do, the first one starts the
        conversation with its messages when nothing was said yet; later ones (the aggregator's record of
        each turn) start nothing: the conversation lives in the omni_rt session. Each carries the tools;
        one coming back upstream from the assistant aggregator once tool results arrived asks for the
        reply to them (as OpenAI's realtime service takes it)."""
        await self._tools.set_context(frame.context)
        if not self._context_seen:
            self._context_seen = True
            await self._first_context(frame)
        elif direction == FrameDirection.UPSTREAM and self._tools.results_waiting:
            self._tools.results_waiting = False
            self._respond(None)

    async def _first_context(self, frame: LLMContextFrame) -> None:
        if self._replies or self._turn.open or (self._session is not None and self._session.conversation):
            return  # the conversation started without it (the user spoke first)
        if await self._append(frame.context.get_messages()):
            self._respond(None)

    async def _append(self, messages: list[Any]) -> bool:
        """Text messages join the next reply's prompt; any other message is an error, and then none
        of them joins (nothing half-applied)."""
        added = []
        for m in messages:
            role = ROLES.get(m.get("role")) if isinstance(m, dict) else None
            text = standard_message_text(m) if role is not None else ""
            if not text:
                await self.push_error(
                    f"omni_rt takes text messages (system, user or assistant): {str(m)[:120]!r} is not one; "
                    "the LLMMessagesAppendFrame is ignored"
                )
                return False
            added.append((role, text))
        self._messages += added
        return True

    async def _update_settings(self, delta: LLMSettings) -> dict[str, Any]:
        """LLMUpdateSettingsFrame (LLMService reads the frame, its deprecated dict form too):
        system_instruction is the system prompt from the next reply on (the session's system turn before
        anything is said, later a system turn ahead of the next reply); max_tokens each reply's text limit.
        Others change nothing (a warning)."""
        given = {k: v for k, v in vars(delta).items() if is_given(v) and k != "extra"}
        if "max_tokens" in given:
            self._respond_kwargs["max_output_tokens"] = given.pop("max_tokens")
        if "system_instruction" in given:
            self._instructions = given.pop("system_instruction")
        self._warn_unhandled_updated_settings(given)
        return {}

    async def _system_turn(self) -> list[tuple[str, str]]:
        """The system turn the next reply starts with (`system_turn`); before anything was said a new
        system prompt opens the session anew, as its instructions."""
        system = self._tools.system_prompt(self._instructions)
        if self._session is not None:  # else its open failed (no free slot): it opens now
            turn = system_turn(self._session, self.engine.tokenizer, system)
            if turn is not None:
                return turn
            session, self._session = self._session, None
            await session.close()
        kwargs = self._session_kwargs | {"instructions": system or None}
        self._session = self.engine.session(output_sample_rate=self._out_rate, **kwargs)
        return []

    async def _on_audio(self, frame: InputAudioRawFrame) -> None:
        pcm = self._input.push(frame.audio, frame.sample_rate, frame.num_channels)
        if self._segmenter is None:
            self._turn.push(pcm)
            return
        for ev in self._segmenter.push(pcm):
            if isinstance(ev, SpeechStarted):
                await self.broadcast_frame(UserStartedSpeakingFrame)
                await self.cancel_ttfb_metrics()
                await self._interrupt()
                await self.broadcast_interruption()
            elif isinstance(ev, Turn):
                await self.broadcast_frame(UserStoppedSpeakingFrame)
                self._respond(ev.audio)

    # -- replies ---------------------------------------------------------------------------------------

    def _respond(self, audio: Any) -> None:
        """Answer a turn (spoken, or None: the messages added since the last reply). One reply at a time: a
        turn that ends while a reply runs is answered after it."""
        self._replies = [r for r in self._replies if not r.done.is_set()]
        previous = self._replies[-1] if self._replies else None
        reply = _Reply([*self._unheard, *([] if audio is None else [audio])], self._messages)
        self._unheard, self._messages = [], []
        reply.task = self.create_task(self._run(reply, previous), name="omni_rt_reply")
        # a task cancelled before it ran never runs its body: the callback is what always runs
        reply.task.add_done_callback(lambda _task: reply.done.set())
        self._replies.append(reply)

    async def _interrupt(self) -> None:
        """Stop the reply being made, and drop those waiting behind it, before anything else happens
        (as pipecat's realtime services drop a response owed behind an interrupted one)."""
        pending = [r for r in self._replies if not r.done.is_set()]
        if not pending:
            return
        for r in pending:
            r.interrupted = True
            r.cut.set()
        if self._session is not None:
            await self._session.cancel()  # returns once the engine has stopped it (within a codec frame)
        for r in pending:
            await r.done.wait()
        # what the dropped ones would have answered, the user's speech and messages, is not lost: the
        # next reply answers it (before anything added since)
        dropped = [r for r in pending if not r.ran]
        self._messages[:0] = [m for r in dropped for m in r.messages]
        self._unheard[:0] = [turn for r in dropped for turn in r.turns]

    async def _run(self, reply: _Reply, previous: _Reply | None) -> None:
        try:
            if previous is not None:
                await previous.done.wait()
            if not reply.interrupted and not self._ended:
                reply.ran = True
                await self._stream(reply)
        except Exception as e:  # the reply's end reaches the pipeline as an error, never a silent stop
            await self.push_error(f"omni_rt reply failed: {e}", exception=e)

    async def _stream(self, reply: _Reply) -> None:
        t0 = time.time()
        await self.start_ttfb_metrics(start_time=t0)
        await self.start_processing_metrics(start_time=t0)
        try:
            system = await self._system_turn()
        except OmniRtError:  # no session (no free slot): what the reply answers waits for the next
            self._unheard[:0], reply.turns = reply.turns, []
            self._messages[:0] = reply.messages
            raise
        await self.push_frame(LLMFullResponseStartFrame())
        session = self._session  # the reply's own: a cancel whose interrupt failed closes the service first
        prompt = reply_prompt(session, self.engine.tokenizer, system + reply.messages, reply.audio)
        calls = self._tools.parser()  # None: no tools offered
        stream = session.respond(**prompt, **self._respond_kwargs)
        async for ev in stream:
            if ev.type == "response.created":
                reply.response_id = ev.response_id
                if reply.interrupted:  # interrupted while its spoken turn was being encoded
                    await session.cancel()
            elif ev.type == "response.done":
                if ev.status == "failed":  # a failed turn is never recorded: the model heard none of it
                    self._unheard[:0] = reply.turns  # the next reply answers (and transcribes) them
                    reply.turns = []
                    self._refused = users_words(reply.messages, self._refused)
                    self._messages[:0] = self._refused
                if calls is not None and not reply.interrupted and ev.status != "cancelled":
                    for bad in calls.end():  # a call left open by the model, not one cut by a stop
                        await self._bad_call(bad)
                await self._finish(reply, ev)
            elif reply.interrupted:
                continue  # the engine is stopping it: drop what was already on its way
            elif ev.type == "response.output_text.delta":
                speak, found = calls.feed(ev.delta, ev.token_ids) if calls is not None else (ev.delta, [])
                for call in found:
                    await (self._bad_call(call) if isinstance(call, BadToolCall) else self._tools.run(call))
                if speak:
                    text = LLMTextFrame(speak)
                    text.append_to_context = False  # the spoken transcript (TTSTextFrame) is what was said
                    await self.push_frame(text)
            elif calls is not None and calls.calling:
                continue  # from a <tool_call> on nothing more of the reply is spoken
            elif ev.type == "response.output_audio.delta":
                if not reply.started:
                    reply.started = True
                    self._transcribe(reply)  # from its first audio on: the transcripts never delay it
                    await self.stop_ttfb_metrics()
                    await self.push_frame(TTSStartedFrame(context_id=reply.response_id))
                out = TTSAudioRawFrame(
                    audio=ev.pcm.tobytes(), sample_rate=ev.sample_rate, num_channels=1,
                    context_id=reply.response_id,
                )  # fmt: skip
                await self.process_ttfa_metrics(out)
                await self.push_frame(out)
            elif ev.type == "response.output_audio_transcript.delta":
                spoken = TTSTextFrame(ev.delta, text_type=TextType.TOKEN, context_id=reply.response_id)
                spoken.includes_inter_frame_spaces = True  # deltas carry their own spaces
                await self.push_frame(spoken)

    async def _bad_call(self, bad: BadToolCall) -> None:
        """A malformed call (not JSON, an unknown tool, left open): nothing is run; the reply says nothing
        more, as with a good one, and the error says why."""
        await self.push_error(f"omni_rt: the model made a malformed tool call: {bad.message}")

    async def push_frame(self, frame: Frame, direction: FrameDirection = FrameDirection.DOWNSTREAM) -> None:
        """A function call's result or cancellation (LLMService broadcasts them; the downstream copy is taken
        here, as OpenAI's realtime service takes it) joins the next reply's prompt as a tool response."""
        if direction == FrameDirection.DOWNSTREAM and isinstance(
            frame, FunctionCallResultFrame | FunctionCallCancelFrame
        ):
            if (turn := self._tools.result(frame)) is not None:
                self._messages.append(turn)
        await super().push_frame(frame, direction)

    async def _finish(self, reply: _Reply, done: Any) -> None:
        if reply.started:
            await self.push_frame(TTSStoppedFrame(context_id=reply.response_id))
        self._transcribe(reply)
        await self._transcribed_or_cut(reply)
        await self.push_frame(LLMFullResponseEndFrame())
        await self.cancel_ttfb_metrics()  # a reply that made no audio has no time to first audio
        await self.stop_processing_metrics()
        u = done.usage
        await self.start_llm_usage_metrics(
            LLMTokenUsage(
                prompt_tokens=u.input_tokens + u.cached_tokens,
                completion_tokens=u.output_tokens,
                total_tokens=u.input_tokens + u.cached_tokens + u.output_tokens,
                cache_read_input_tokens=u.cached_tokens,
                output_audio_tokens=u.audio_frames,
            )
        )
        await self._call_event_handler("on_response_done", done)
        if done.status == "failed" and done.error is not None:
            await self.push_error(f"omni_rt response failed: {done.error.message}")

    # -- the user's transcript -------------------------------------------------------------------------

    def _spawn_transcription(self, coro: Any, name: str) -> asyncio.Task:
        self._transcription_task = self.create_task(coro, name=name)
        return self._transcription_task

    def _transcribe(self, reply: _Reply) -> None:
        """Start transcribing the turns `reply` answers (once): at its first audio, or at its end."""
        if self._transcriber is not None and reply.transcripts is None:
            reply.transcripts = []
            for turn in reply.turns:
                self._turn_ids += 1
                reply.transcripts.append(self._transcriber.add(f"turn_{self._turn_ids}", turn))

    async def _transcribed_or_cut(self, reply: _Reply) -> None:
        """Wait for the reply's transcripts (the aggregator then writes the user's message first), unless it
        is interrupted: an interruption never waits for a transcript."""
        if not reply.transcripts or reply.interrupted:
            return
        cut = asyncio.ensure_future(reply.cut.wait())
        try:
            for transcript in reply.transcripts:
                await asyncio.wait({transcript, cut}, return_when=asyncio.FIRST_COMPLETED)
                if cut.done():
                    return
        finally:
            cut.cancel()

    async def _transcribing(self, turn_id: str, delta: str) -> None:
        text = self._transcripts[turn_id] = self._transcripts.get(turn_id, "") + delta
        await self.push_frame(
            InterimTranscriptionFrame(text=text, user_id=self.user_id, timestamp=time_now_iso8601()),
            FrameDirection.UPSTREAM,
        )

    async def _transcribed(self, t: Transcript) -> None:
        self._transcripts.pop(t.item_id, None)
        if t.error is not None:
            code, message = t.error
            await self.push_error(f"omni_rt could not transcribe the user's turn ({code}): {message}")
            return
        frame = TranscriptionFrame(
            text=t.text, user_id=self.user_id, timestamp=time_now_iso8601(), result=t, finalized=True
        )
        await self.push_frame(frame, FrameDirection.UPSTREAM)
