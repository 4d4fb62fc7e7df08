"""One connection's replies: one at a time, each a task from its Session's events to the client, cut by a
barge-in, and what the client heard of it.

The peer decides what a reply answers and with which limits (`peer.py`) and hands it here as a
`Response` (`responses.py`: one reply's wire events) to `start`. Its task reads the Session's events
and plays its audio on the WebRTC track (`media.py`) or sends it as deltas. Speech that starts
(`interrupt`), `response.cancel` and `output_audio_buffer.clear` cut it at once: no more of its audio
goes out and the model is stopped in a task, so the microphone keeps being read. A reply cut off on the
track records what was played of it (`conversation.item.truncated`), as `conversation.item.truncate`
does for one the client cut itself. When a reply ends, `on_idle` starts the one a turn left waiting;
when the Session failed it, `on_refused` first puts back the input it read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from omni_rt import wire
from omni_rt.errors import OmniRtError
from omni_rt.server import protocol
from omni_rt.server.protocol import ProtocolError
from omni_rt.server.responses import CancelReason, Response
from omni_rt.server.track import FRAME_SAMPLES
from omni_rt.server.track import SAMPLE_RATE as TRACK_RATE

if TYPE_CHECKING:
    from omni_rt.server.media import Media
    from omni_rt.server.speculative import Speculator
    from omni_rt.server.track import AudioOutputTrack
    from omni_rt.server.transcription import InputTranscriber

log = logging.getLogger("omni_rt.server")

KEPT_ITEMS = 64  # assistant items remembered for conversation.item.truncate


class Replies:
    def __init__(
        self,
        name: str,
        *,
        session: Callable[[], Any],
        send: Callable[[dict[str, Any]], None],
        spawn: Callable[[Any, str], asyncio.Task],
        closing: Callable[[], bool],
        media: Media,
        transcriber: InputTranscriber,
        speculator: Speculator,
        on_idle: Callable[[], None],
        on_refused: Callable[[], None],
    ) -> None:
        self.name = name
        self._session = session  # the peer's Session now (session.update opens a new one)
        self.send, self._spawn, self._closing = send, spawn, closing
        self.media = media
        self.transcriber, self.speculator = transcriber, speculator
        self._on_idle = on_idle
        self._on_refused = on_refused  # a reply the Session failed: its input waits again
        self.current: Response | None = None
        self.respond_when_idle = False  # a VAD turn ended during a response: answer it after
        self.items: OrderedDict[str, Response] = OrderedDict()  # recent assistant items by id
        self.count = 0  # replies the session started (response.created)

    @property
    def track(self) -> AudioOutputTrack | None:
        return self.media.track

    def start(self, response: Response, limits: dict[str, Any], held: Any = None) -> None:
        """Run `response` with `Session.respond(**limits)`, or release `held`, the speculative reply
        started for this turn at its pause."""
        if self.track is not None and self.track.response_id is not None:
            # The previous reply is still playing (playout is real time, generation faster): the
            # conversation has moved on, so its unplayed audio goes rather than delaying the new reply.
            playing = self.track.response_id
            self.drop_queued_audio()
            self.send(wire.output_audio_buffer("cleared", playing))
        self.transcriber.hold()  # until its first audio: transcripts never come before the answer
        self.current = response
        self.items[response.item_id] = response
        while len(self.items) > KEPT_ITEMS:
            self.items.popitem(last=False)
        response.task = self._spawn(self._run(response, limits, held), "response")

    # -- cutting a reply --------------------------------------------------------------------------------

    async def on_response_cancel(self, event: protocol.ResponseCancel) -> None:
        response = self.current
        # A response already cut is stopping: a second cancel has nothing active to cancel.
        if response is None or response.cancelled or (event.response_id and event.response_id != response.id):
            raise ProtocolError(
                "response_cancel_not_active",
                "there is no response in progress to cancel",
                event_id=event.event_id,
            )
        await self.cancel(response, event.event_id)

    async def on_audio_clear(self, event: protocol.OutputAudioBufferClear) -> None:
        """Silence the track now: the reply in progress is cancelled, or the one still playing cut off."""
        if self.track is None:
            raise ProtocolError(
                "unsupported_event",
                "output_audio_buffer.clear needs a WebRTC audio track",
                event_id=event.event_id,
            )
        self.interrupt("client_cancelled")

    def interrupt(self, reason: CancelReason) -> None:
        """Barge-in, at once: the reply in progress is cut and cancelled, or the one still playing cut
        off. Nothing here waits, so the microphone keeps being read; the model stops in a task."""
        response = self.current
        if response is not None:
            if self._cut(response, reason) and (session := self._session()) is not None:
                self._spawn(self._cancel_session(session), "barge-in")
            return
        playing = self.track.response_id if self.track is not None else None
        if playing is not None:
            self._record_played(next((r for r in self.items.values() if r.id == playing), None))
        self.drop_queued_audio()
        if playing is not None:
            self.send(wire.output_audio_buffer("cleared", playing))

    async def cancel(self, response: Response, event_id: str | None = None) -> None:
        """Barge-in: stop the model, drop every sample not yet sent, keep the session."""
        if self._cut(response) and (session := self._session()) is not None:
            await self._cancel_session(session, event_id)

    def _cut(self, response: Response, reason: CancelReason = "client_cancelled") -> bool:
        """Silence a response now: no more of its audio goes out. False if it was already cut."""
        if response.cancelled:
            return False
        response.cancelled = True
        response.reason = reason
        self._record_played(response)
        self.drop_queued_audio()
        if response.id is not None and self.track is not None:
            self.send(wire.output_audio_buffer("cleared", response.id))
        return True

    def drop_queued_audio(self) -> None:
        self.media.drop_queued()

    def _record_played(self, response: Response | None) -> None:
        """A reply cut off on the track: the client heard what was sent of it, and the item says so,
        as if the client had sent conversation.item.truncate (OpenAI's WebRTC sessions do the same)."""
        track = self.track
        if response is None or track is None or track.response_id is None or track.response_id != response.id:
            return
        response.played_ms = track.response_frames * 1000.0 * FRAME_SAMPLES / TRACK_RATE
        self.send(wire.conversation_item_truncated(response.item_id, 0, round(response.played_ms)))

    def on_item_truncate(self, event: protocol.ConversationItemTruncate) -> None:
        """Record how much of a reply the client played. The session keeps the whole reply in its
        conversation (the model's context is not rewritten); the client's transcript is its own."""
        response = self.items.get(event.item_id)
        if response is None:
            raise ProtocolError(
                "invalid_value", f"no assistant item {event.item_id!r} with audio", param="item_id",
                event_id=event.event_id,
            )  # fmt: skip
        if event.content_index != 0:
            raise ProtocolError(
                "invalid_value", "an assistant item has one content part (index 0)", param="content_index",
                event_id=event.event_id,
            )  # fmt: skip
        if event.audio_end_ms > response.audio_ms + 1:  # + 1: the client's rounding
            raise ProtocolError(
                "invalid_value",
                f"audio_end_ms {event.audio_end_ms} is past the item's audio ({response.audio_ms:.0f} ms)",
                param="audio_end_ms",
                event_id=event.event_id,
            )
        response.played_ms = float(event.audio_end_ms)
        self.send(wire.conversation_item_truncated(event.item_id, event.content_index, event.audio_end_ms))

    async def _cancel_session(self, session: Any, event_id: str | None = None) -> None:
        try:
            await session.cancel()
        except OmniRtError as exc:  # the pipeline did not stop in time: the response.done says failed
            log.warning("peer %s: cancel failed: %s", self.name, exc)
            self.send(
                protocol.error(
                    ProtocolError(type(exc).__name__, str(exc), type="server_error", event_id=event_id)
                )
            )

    # -- running a reply --------------------------------------------------------------------------------

    async def _run(self, response: Response, limits: dict[str, Any], held: Any = None) -> None:
        """`held`: the speculative reply started for this turn at its pause, released now."""
        use_track = self.track is not None
        try:
            if held is not None:
                replies = held.release()
            else:
                await self.speculator.settled()  # a dropped one first lets go of the session
                replies = self._session().respond(**limits)
            stopped = False
            async for ev in replies:
                kind = ev.type
                if response.cancelled and not stopped and kind not in ("response.created", "response.done"):
                    # Cut before the session had this response in hand (a barge-in while it was
                    # starting): its cancel found nothing to stop, so stop it now.
                    stopped = True
                    self._spawn(self._cancel_session(self._session()), "cancel")
                if kind == "response.created":
                    self.count += 1
                    response.created(ev.response_id)
                elif response.id is None:
                    continue  # nothing precedes response.created in a well-formed stream
                elif kind == "response.output_text.delta":
                    response.text_delta(ev.delta, ev.token_ids)
                elif kind == "response.output_audio_transcript.delta":
                    response.transcript_delta(ev.delta)
                elif kind == "response.output_audio.delta":
                    if not response.audio or response.cancelled or not response.speaking:
                        continue
                    response.audio_ms += 1000.0 * len(ev.pcm) / ev.sample_rate
                    if response.spoken is not None:
                        response.spoken.audio_out(time.monotonic())
                    self.transcriber.release()
                    if use_track:
                        response.audio_started()
                        await self.media.play(response, ev.pcm, ev.sample_rate)
                    else:  # in deltas of at most 500 ms: a long chunk would not fit a data channel message
                        step = ev.sample_rate // 2
                        for start in range(0, len(ev.pcm), step):
                            response.audio_delta(ev.pcm[start : start + step])
                elif kind == "response.output_audio.done":
                    if response.audio and not response.cancelled and response.speaking:
                        if use_track:
                            await self.media.end(response)
                        response.audio_done()
                elif kind == "error":
                    self.send(protocol.error(_session_error(ev)))
                elif kind == "response.done":
                    response.done(ev)
        except asyncio.CancelledError:
            raise
        except OmniRtError as exc:
            self.send(protocol.error(ProtocolError(type(exc).__name__, str(exc), type="server_error")))
        except Exception:
            log.exception("peer %s: response failed", self.name)
            self.send(
                protocol.error(ProtocolError("server_error", "the response failed", type="server_error"))
            )
        finally:
            self.transcriber.release()
            if not self._closing():
                response.broken()  # the Session promises response.done; if the stream broke anyway
                if response.refused:
                    self._on_refused()
            if self.current is response:
                self.current = None
                if self.respond_when_idle and not self._closing():
                    self._on_idle()

    async def stop(self) -> None:
        """On close: drop a held speculative reply and cancel the response in progress (which frees
        their GPU work), and wait for them."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.speculator.close(), 5.0)
        response = self.current
        if response is None:
            return
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.cancel(response), 5.0)
        if response.task is not None:
            try:
                # Let it see its response.done (the session's promise); then stop it regardless.
                await asyncio.wait_for(asyncio.shield(response.task), 2.0)
            except TimeoutError:
                response.task.cancel()
                await asyncio.gather(response.task, return_exceptions=True)
            except Exception:
                pass


def _session_error(ev: Any) -> ProtocolError:
    info = ev.error
    return ProtocolError(info.code or "error", info.message, type=info.type)
