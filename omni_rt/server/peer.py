"""One client connection ↔ one `Session`: its lifetime, the client's events, what its replies answer.

A connection is a WebSocket (`/v1/realtime`, `/ws`) or a call (`POST /v1/realtime/calls`, no socket).
The server opens a Session for it at once and says `session.created`. Its parts, each in its module:
`transport.py` moves the events (socket, data channel), `media.py` the WebRTC audio (offer, reply
track, microphone), `listening.py` the speech input (server VAD, turns), `conversation.py` the items
and the input waiting for a reply, `replies.py` the reply in progress (its task, barge-in, what was
played of it), `responses.py` one reply's wire events. This module ties them: every client event, from
the socket or the data channel, goes through one bounded inbox and is handled in order by one loop; the
session's configuration is applied here, and each reply's input and limits decided here. The connection
lives as long as its socket or its call: when it ends (or WebRTC fails), the response in progress is
cancelled, which stops its GPU work, and the session is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from omni_rt import tools as template
from omni_rt import wire
from omni_rt.errors import OmniRtError
from omni_rt.server import protocol, tools, webrtc
from omni_rt.server.conversation import Conversation
from omni_rt.server.listening import SpeechInput
from omni_rt.server.media import Media
from omni_rt.server.protocol import ProtocolError
from omni_rt.server.replies import Replies
from omni_rt.server.responses import Response
from omni_rt.server.speculative import Speculator
from omni_rt.server.speech import SPEECH_RATE, InputAudioBuffer, TurnDetection
from omni_rt.server.track import AudioOutputTrack, Idle
from omni_rt.server.transcription import InputTranscriber, transcription_update
from omni_rt.server.transport import Transport

if TYPE_CHECKING:
    from websockets.asyncio.server import ServerConnection

log = logging.getLogger("omni_rt.server")

# A fatal error's close code: 1008 (policy violation) unless it says otherwise; no free session slot
# (the one given back to reopen the Session was taken) is 1013, try again later, as at connect.
CLOSE_CODES = {"session_limit": 1013, "session_unavailable": 1013}
INBOX_SIZE = 64  # client events waiting to be handled; a client that floods gets an error
SESSION_SAMPLE_RATE = 24000  # what socket clients receive (the model's own rate); the track makes 48 kHz


@dataclass(frozen=True)
class PeerSettings:
    """What every connection is allowed and how it behaves; the server passes one to each peer."""

    model: str = "omni_rt"
    voice: str = "ethan"
    instructions: str | None = None
    ice_servers: Sequence[str] = ()  # used only by a server bound to all interfaces (see webrtc.py)
    ice_public_address: str | None = None  # announced in place of the bound address (a 1:1 NAT)
    # Where media may flow; the Server sets it from its bind address (None: every interface).
    ice_policy: webrtc.IcePolicy | None = None
    idle: Idle = "silence"  # see AudioOutputTrack: "nothing" grows the browser's jitter buffer
    # Audio of a reply buffered before it starts playing (AudioOutputTrack); None: the engine's
    # `EngineSettings.playout_lead_ms`, which its Code2Wav chunk plan counts on (0 without one).
    start_lead_ms: int | None = None
    max_message_bytes: int = protocol.MAX_MESSAGE_BYTES
    max_output_tokens: int = 1024  # a client may ask for fewer, never more
    # The Talker stops at its end-of-speech code; this caps a reply that never gets there (random
    # weights do not) at 60 s of audio (a codec frame is 80 ms).
    max_audio_frames: int = 750
    # Server VAD for new connections (a client changes it with session.update; None: off).
    turn_detection: TurnDetection | None = field(default_factory=TurnDetection)
    max_turn_ms: int = 30_000  # longest user turn: VAD ends it there; without VAD the buffer is full
    # User input waiting for the next response (text items, committed speech): past these, more is
    # refused (pending_input_full), so a client that never asks for a response cannot grow memory.
    max_pending_text_chars: int = 4 * protocol.MAX_TEXT_CHARS
    max_pending_audio_ms: int = 60_000


class Peer:
    def __init__(
        self,
        engine: Any,
        ws: ServerConnection | None,
        settings: PeerSettings,
        sessions: Sequence[protocol.SessionFields] = (),
    ) -> None:
        """`ws` None: a call (`POST /v1/realtime/calls`), whose events travel on its data channel alone
        and which lives until it is hung up or its WebRTC connection ends. `sessions`: the initial
        configuration (a client secret's, then the call's own over it), applied before `session.created`."""
        self.engine = engine
        self.ws = ws
        self.settings = settings
        self._initial = list(sessions)
        self.session_id = wire.new_id("sess")
        self.voice = settings.voice
        self.instructions = settings.instructions or ""
        self.tools: list[tools.Tool] = []  # function calling: in the system turn (see tools.py)
        self.tool_choice: tools.ToolChoice = "auto"
        self.output_modalities: list[str] = ["audio"]
        self.max_output_tokens: int | str = "inf"  # "inf": the server's limit

        self.session: Any = None
        self._opened_with = ""  # the system prompt the Session opened with
        self._session_stack: contextlib.AsyncExitStack | None = None
        self._inbox: asyncio.Queue[tuple[str | bytes, str] | None] = asyncio.Queue(INBOX_SIZE)
        self.transport = Transport(ws, self.session_id, self._inbox, self._shutdown)
        self.send = self.transport.send
        self._tasks: set[asyncio.Task] = set()
        self._closed = asyncio.Event()
        self._closing = False
        self._task_failed = False  # one of this peer's tasks raised: the connection ends with 1011

        self.conversation = Conversation(self.send, settings.max_pending_text_chars)
        self.transcriber = InputTranscriber(engine, self.send, self._spawn)  # audio.input.transcription
        self.speculator = Speculator(self.session_id, self._spawn)  # the reply ready when they stop
        self.speech = SpeechInput(
            self.session_id,
            settings.turn_detection,
            max_turn_ms=settings.max_turn_ms,
            max_pending_ms=settings.max_pending_audio_ms,
            send=self.send,
            conversation=self.conversation,
            on_speech_started=lambda: self.replies.interrupt("turn_detected"),
            on_turn=self._on_turn,
            on_committed=self.transcriber.add,
            live_speech=lambda: self.session.live_speech() if self.session is not None else None,
            on_pause=self._on_pause,
            on_resume=self.speculator.drop,
        )
        self.media = Media(
            self.session_id,
            settings,
            send=self.send,
            spawn=self._spawn,
            shutdown=self._shutdown,
            closing=lambda: self._closing,
            attach_channel=self.transport.attach_channel,
            on_mic_frame=self.speech.mic_frame,
        )

        self.replies = Replies(
            self.session_id,
            session=lambda: self.session,
            send=self.send,
            spawn=self._spawn,
            closing=lambda: self._closing,
            media=self.media,
            transcriber=self.transcriber,
            speculator=self.speculator,
            on_idle=self._start_response,
            on_refused=self.conversation.refused,
        )

    # -- lifetime ---------------------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve this connection until the socket closes or the peer fails; always cleans up."""
        try:
            if self.ws is not None:
                self._spawn(self.transport.write_socket(), "socket writer")
            try:
                await self.open()
            except OmniRtError as exc:
                await self.transport.fail(
                    ProtocolError(protocol.unopened_code(exc), str(exc), type="server_error"), 1013
                )
                return
            self.send(wire.session_created(self.session_object()))
            if self.ws is not None:
                self._spawn(self.transport.read_socket(), "socket reader")
            while (item := await self._inbox.get()) is not None:
                raw, source = item
                self.transport.taken(raw, source)
                try:
                    await self._handle(raw, source)
                except ProtocolError as exc:
                    if not exc.fatal:
                        self.send(protocol.error(exc))
                        continue
                    # The socket is what closes: the error goes there, where it is sure to arrive first.
                    await self.transport.fail(exc, CLOSE_CODES.get(exc.code, 1008))
                    return
            if self._task_failed:
                await self.transport.fail(
                    ProtocolError("server_error", "internal error", type="server_error"), 1011
                )
        except asyncio.CancelledError:
            raise
        except Exception:
            # A bug here must cost this client its connection, never the server.
            log.exception("peer %s failed", self.session_id)
            await self.transport.fail(
                ProtocolError("server_error", "internal error", type="server_error"), 1011
            )
        finally:
            await self.close()

    async def close(self) -> None:
        """Stop everything this peer started. Safe to call more than once, from anywhere.

        Every step runs whatever the one before it did: a step that raises (aiortc's close of a
        half-negotiated connection does) is logged, and the session slot is still given back."""
        if self._closing:
            await self._closed.wait()
            return
        self._closing = self.transport.closing = True
        try:
            for step in (
                self.replies.stop,
                self.media.stop_track,
                self._stop_tasks,
                self.media.close,
                self._close_session,
                self.transport.close,
            ):
                try:
                    await step()
                except Exception:
                    log.exception("peer %s: %s failed while closing", self.session_id, step.__name__)
        finally:
            self._closed.set()

    @property
    def track(self) -> AudioOutputTrack | None:
        return self.media.track

    @property
    def responses(self) -> int:
        """Replies the session started on this connection."""
        return self.replies.count

    @property
    def input(self) -> InputAudioBuffer:
        return self.speech.buffer

    @property
    def input_audio_frames(self) -> int:
        return self.speech.frames

    async def _stop_tasks(self) -> None:
        current = asyncio.current_task()
        tasks = [t for t in self._tasks if t is not current]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _close_session(self) -> None:
        stack, self._session_stack, self.session = self._session_stack, None, None
        if stack is not None:
            await stack.aclose()

    async def open(self) -> None:
        """Open the Session (once), configured as the initial session says. `OmniRtError`: no slot."""
        if self.session is not None:
            return
        initial, self._initial = self._initial, []
        for fields in initial:
            self.configure(fields)
        await self._open_session()

    async def answer_call(self, sdp: str) -> str:
        """A call's offer (after `open()`): the SDP answer. `ProtocolError` (invalid_sdp) if unusable."""
        return await self.media.answer(sdp)

    def hang_up(self) -> None:
        self._shutdown()

    def _spawn(self, coro: Any, name: str) -> asyncio.Task:
        task = asyncio.create_task(coro, name=f"{self.session_id} {name}")
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        # A bug in a task (the track feeder, the microphone) would otherwise end it silently and
        # leave the client waiting: it costs this client its connection, as a bug in run() does.
        log.error("peer %s: %s failed", self.session_id, task.get_name(), exc_info=task.exception())
        self._task_failed = True
        self._shutdown()

    def _shutdown(self) -> None:
        """Ask the main loop to end (socket gone, WebRTC failed, client too slow)."""
        with contextlib.suppress(asyncio.QueueFull):
            self._inbox.put_nowait(None)
        if self._inbox.full():
            # The inbox is full of client events: make room for the sentinel; they will not be served.
            while not self._inbox.empty():
                self._inbox.get_nowait()
            self._inbox.put_nowait(None)

    async def _open_session(self) -> None:
        stack = contextlib.AsyncExitStack()
        kwargs: dict[str, Any] = {"voice": self.voice, "output_sample_rate": SESSION_SAMPLE_RATE}
        if system := self._system_prompt():
            kwargs["instructions"] = system
        self.session = await stack.enter_async_context(self.engine.session(**kwargs))
        self._session_stack = stack
        self._opened_with = system  # the Session's first turn: truncation never drops it

    def _system_prompt(self) -> str:
        return template.system_prompt(self.instructions, self.tools, self.tool_choice)

    def session_object(self) -> dict[str, Any]:
        session = wire.session_object(
            self.session_id,
            self.settings.model,
            self.voice,
            self.instructions,
            self.output_modalities,
            SESSION_SAMPLE_RATE,
            self.max_output_tokens,
            None if self.speech.detection is None else self.speech.detection.to_wire(),
            tools=tools.tool_dicts(self.tools),
            tool_choice=self.tool_choice
            if isinstance(self.tool_choice, str)
            else self.tool_choice.model_dump(),
        )
        if self.transcriber.setting is not None:
            session["audio"]["input"]["transcription"] = self.transcriber.setting
        return session

    # -- client events ----------------------------------------------------------------------------------

    async def _handle(self, raw: str | bytes, source: str) -> None:
        if isinstance(raw, bytes) and source == "socket":
            raise ProtocolError("invalid_event", "binary messages are not accepted: send JSON text")
        event = protocol.parse_client_event(raw, self.settings.max_message_bytes)
        match event:
            case protocol.WebRtcOffer():
                if source != "socket":
                    raise ProtocolError(
                        "invalid_event", "send webrtc.offer on the WebSocket", event_id=event.event_id
                    )
                answer = await self.media.answer(event.sdp, event.event_id)
                # Signaling goes on the socket: the data channel does not exist until this answer lands.
                self.transport.send_socket(json.dumps(wire.webrtc_answer(answer)))
            case protocol.SessionUpdate():
                await self._on_session_update(event)
            case protocol.ConversationItemCreate():
                self.conversation.create(event)
            case protocol.ResponseCreate():
                self._on_response_create(event)
            case protocol.ResponseCancel():
                await self.replies.on_response_cancel(event)
            case protocol.OutputAudioBufferClear():
                await self.replies.on_audio_clear(event)
            case protocol.InputAudioBufferAppend():
                await self.speech.append(event)
            case protocol.InputAudioBufferCommit():
                self.speech.commit(event)
            case protocol.InputAudioBufferClear():
                self.speech.clear()
            case protocol.ConversationItemTruncate():
                self.replies.on_item_truncate(event)
            case protocol.ConversationItemRetrieve():
                self.conversation.retrieve(event)
            case protocol.ConversationItemDelete():
                self.conversation.delete(event)

    def configure(self, s: protocol.SessionFields, event_id: str | None = None) -> bool:
        """Apply a session configuration (all of it, or nothing: `ProtocolError`). True when the system
        prompt (instructions, tools) changed before the conversation began: the caller opens a new Session
        with it. Once it has begun, or while a reply runs (as OpenAI's server, the change is the next
        reply's; the running one keeps what it started with), the next reply adds the new one as a system
        turn (`_system_due`), so nothing said is lost; a new voice is each reply's own (`_limits`)."""
        voice = s.voice or (s.audio.output.voice if s.audio and s.audio.output else None)
        if voice is not None:
            try:  # checked before the current session is given up
                voice = protocol.model_voice(self.engine, voice)
            except ProtocolError as exc:
                exc.param, exc.event_id = "session.audio.output.voice", event_id
                raise
        instructions = s.instructions
        new_tools = self.tools if s.tools is None else list(s.tools)
        choice = self.tool_choice if s.tool_choice is None else s.tool_choice
        if isinstance(choice, tools.FunctionChoice) and choice.name not in {t.name for t in new_tools}:
            raise ProtocolError(
                "invalid_value",
                f"tool_choice names {choice.name!r}, which is not one of the session's tools",
                param="session.tool_choice.name",
                event_id=event_id,
            )
        system = template.system_prompt(
            self.instructions if instructions is None else instructions, new_tools, choice
        )
        changed = system != self._system_prompt()
        if changed:  # a Session opened with it has it as its first turn; else it follows the first
            param = "session.instructions" if instructions else "session.tools"
            kept = self._opened_with if self._begun() else ""
            max_tokens = self._max_tokens(s.max_output_tokens)
            protocol.check_system_turn(self.engine, system, kept, max_tokens, param, event_id)
        given, detection = protocol.turn_detection_of(s)
        transcription_given, transcription = transcription_update(s, event_id)
        # Valid: apply all of it.
        if transcription_given:
            self.transcriber.configure(transcription)
        if given:
            self.speech.set_detection(None if detection is None else TurnDetection.from_wire(detection))
        modalities = s.output_modalities or s.modalities
        if modalities is not None:
            self.output_modalities = list(dict.fromkeys(modalities))
        if s.max_output_tokens is not None:
            self.max_output_tokens = s.max_output_tokens
        self.voice = voice or self.voice
        self.instructions = instructions if instructions is not None else self.instructions
        self.tools, self.tool_choice = new_tools, choice
        return changed and not self._begun()

    def _begun(self) -> bool:
        """Whether the Session's conversation has begun: its opening system turn is then kept for good."""
        said = self.session is not None and bool(self.session.conversation)
        return said or self.replies.current is not None  # a running reply commits its turn at its end

    async def _on_session_update(self, event: protocol.SessionUpdate) -> None:
        if self.configure(event.session, event.event_id):
            # Nothing said yet: a fresh Session opens with the new system prompt as its first turn.
            # Meanwhile there is no session: a spoken turn that ends now waits for the new one.
            await self._close_session()
            try:
                await self._open_session()
            except OmniRtError as exc:  # the engine stopped, or lost its slot to another client
                raise ProtocolError(
                    protocol.unopened_code(exc),
                    str(exc),
                    type="server_error",
                    event_id=event.event_id,
                    fatal=True,
                ) from None
        self.send(wire.session_updated(self.session_object()))
        if self.replies.respond_when_idle and self.replies.current is None:
            self._start_response()

    def _on_response_create(self, event: protocol.ResponseCreate) -> None:
        if self.replies.current is not None:
            raise ProtocolError(
                "conversation_already_has_active_response",
                "a response is already in progress; cancel it first",
                event_id=event.event_id,
            )
        fields = event.response
        if fields.voice is not None:
            try:
                fields.audio.output.voice = protocol.model_voice(self.engine, fields.voice)
            except ProtocolError as exc:
                exc.param, exc.event_id = "response.audio.output.voice", event.event_id
                raise
        # What a response cannot do here: the Session's one conversation is its KV cache, and its
        # system turn (instructions, tools) is fixed when it opens (docs/protocol.md, differences).
        # The session's own tools again are no change (livekit's OpenAI plugin asks for the reply after a
        # tool call with them); other tools would need another system turn.
        other_tools = fields.tools is not None and tools.tool_dicts(fields.tools) != tools.tool_dicts(
            self.tools
        )
        other_choice = fields.tool_choice is not None and fields.tool_choice != self.tool_choice
        for name, refused in (
            ("conversation", fields.conversation == "none"),
            ("input", "input" in (fields.model_extra or {})),
            ("tools", other_tools),
            ("tool_choice", other_choice),
        ):
            if refused:
                raise ProtocolError(
                    "unsupported_value",
                    f"response.{name} is not supported: responses answer the one conversation; "
                    + ("add input as items" if name == "input" else f"set {name} with session.update")
                    + (" (the session's own are accepted)" if name.startswith("tool") else ""),
                    param=f"response.{name}",
                    event_id=event.event_id,
                )
        if (refused := self.conversation.unanswerable(event.event_id)) is not None:
            raise refused
        if fields.instructions:  # a system turn of this reply's own, after the one that is due
            system = "\n\n".join(filter(None, (self._system_due(), fields.instructions)))
            max_tokens = self._max_tokens(fields.max_output_tokens)
            protocol.check_system_turn(
                self.engine, system, self._opened_with, max_tokens, "response.instructions", event.event_id
            )
        self._start_response(fields)

    def _start_response(self, fields: protocol.ResponseFields | None = None) -> None:
        """Answer the conversation as it stands: what was added since the last response (user text and
        speech in one user turn; system and assistant messages as their own turns), or nothing new."""
        if (refused := self.conversation.unanswerable()) is not None:  # a reply server VAD asked for
            self.replies.respond_when_idle = False
            self.send(protocol.error(refused))  # the input waits: the client deletes what cannot join
            return
        fields = fields or protocol.ResponseFields()
        messages, audio = self.conversation.take()
        said = [("system", fields.instructions)] if fields.instructions else []  # kept in the context
        text = prompt = None
        system: list[str] = []
        if audio is not None or (messages and all(role == "user" for role, _ in messages)):
            # the Session adds the chat template: system text as a turn before the user turn, text or spoken
            system = [t for role, t in messages + said if role == "system"]
            text = "\n".join(t for role, t in messages if role != "system") or None
        else:  # system and assistant messages as their own turns, then the instructions
            prompt = self._prompt(messages + said)
        self.replies.respond_when_idle = False
        limits = self._limits(self._max_tokens(fields.max_output_tokens), text, audio, prompt, system)
        if fields.voice is not None:  # this reply's own voice (already a model voice, see above)
            limits["voice"] = fields.voice
        held = self.speculator.take(self.session, (text, audio, limits))  # or it is dropped
        response = Response(
            item_id=wire.new_id("item"),
            modalities=list(
                dict.fromkeys(fields.output_modalities or fields.modalities or self.output_modalities)
            ),
            max_tokens=self._max_tokens(fields.max_output_tokens),
            asked_max_tokens=fields.max_output_tokens or self.max_output_tokens,
            voice=fields.voice or self.voice,
            sample_rate=SESSION_SAMPLE_RATE,
            send=self.send,
            metadata=fields.metadata,
            place=self.conversation.place,
            tools=self._tool_parser(),
            spoken=self.speech.spoken_turn,
        )
        self.speech.spoken_turn = None
        self.replies.start(response, limits, held)

    def _limits(
        self,
        max_tokens: int,
        text: str | None,
        audio: Any,
        prompt: list[int] | None,
        system: Sequence[str] = (),
    ) -> dict:
        """`Session.respond`'s arguments for a reply (a speculative one is given the same); `system`: the
        reply's system messages, in one system turn after the one that is due."""
        limits: dict[str, Any] = {
            "text": text,
            "max_output_tokens": max_tokens,
            "max_audio_frames": self.settings.max_audio_frames,
            "voice": self.voice,
        }
        if audio is not None:
            limits |= {"audio": audio, "audio_sample_rate": SPEECH_RATE}
        if prompt is not None:
            limits["input_ids"] = prompt  # with the due system turn in it (`_prompt`)
        else:
            due = self._system_due()
            if parts := ([] if due is None else [due]) + list(system):
                limits["instructions"] = "\n\n".join(parts)
        return limits

    def _system_due(self) -> str | None:
        """The system prompt the next reply adds as a turn of its own (`omni_rt.tools.system_due`)."""
        if self.session is None:
            return None
        return template.system_due(self.session.conversation, self.engine.tokenizer, self._system_prompt())

    def _on_pause(self, pause_clip: Any) -> None:
        """A pause that may end the turn: start the reply its end would start (server/speculative.py),
        when that reply is sure to be this turn's clip with the user text waiting, and nothing else."""
        detection = self.speech.detection
        if (
            detection is None
            or not (detection.speculative_response and detection.create_response)
            or self.replies.current is not None
            or self.session is None
            or self._closing
        ):
            return
        turns, speech = self.conversation.waiting()
        if speech or any(role != "user" for role, _ in turns):
            return  # answered as one clip of all the speech waiting, or not as a user turn
        text = "\n".join(t for _, t in turns) or None
        clip = pause_clip()
        limits = self._limits(self._max_tokens(), text, clip, None)
        self.speculator.start(self.session, (text, clip, limits), **limits)

    def _tool_parser(self) -> template.ToolCallParser | None:
        return template.tool_parser(self.tools, self.tool_choice)

    def _prompt(self, messages: list[tuple[str, str]]) -> list[int]:
        """The prompt of a reply whose new turns the Session's `text=` cannot say (system or assistant
        messages, or no new input at all): chat-formatted by the engine's tokenizer, ending with the
        assistant header. The first turn of a session carries its instructions, as `text=` would; a later
        one the system prompt that is due (`_system_due`)."""
        first = not self.session.conversation
        system = (self._system_prompt() or None) if first else self._system_due()
        if system is not None:
            messages = [("system", system), *messages]
        return self.engine.tokenizer.chat_prompt(messages)

    def _on_turn(self) -> None:
        """Server VAD committed a turn with create_response: answer it, now or when ready."""
        if self.replies.current is None and self.session is not None:
            self._start_response()
        else:  # still stopping (or not interrupted), or a new voice: answer when ready
            self.replies.respond_when_idle = True

    def _max_tokens(self, asked: int | str | None = None) -> int:
        """A response's token limit: what it asks for, else the session's, never over the server's."""
        asked, limit = asked or self.max_output_tokens, self.settings.max_output_tokens
        return limit if asked == "inf" else max(1, min(int(asked), limit))
