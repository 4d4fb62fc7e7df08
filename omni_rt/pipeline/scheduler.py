"""The streaming scheduler: three stage threads (Thinker, Talker, Code2Wav) joined by inboxes.

Plain Python: it moves token ids, codes and PCM between stage runners (see `stages.py`) and applies the
pipeline's policy; it never touches tensors. This module is the wiring (threads, inboxes, the done
protocol, failure fan-out); each stage thread's loop and its per-request state live in its own module. Every hand-off is a message that wakes the receiver through
a Condition (`Inbox`); nothing sleeps on a timer or polls.

    Thinker thread   admit → prefill → first token ─┬─ text deltas → session         (its loop: `thinker.py`)
                     (wait ≤ yield_to_talker_ms for a pending frame 0) → batched decode step → ...
                                                    ▼ FirstToken, TextToken, TextEnd
    Talker thread    prefix prefill (during the Thinker prefill) → last position at the first token →
                     code 0 → code predictor → frame 0 → one frame per next text token (batched)
                     (its loop: `talker.py`)
                                                    ▼ Frame, AudioEnd
    Code2Wav thread  chunks of 1, 2, 4, ... frames → exact streaming decode → PCM → session
                     (its loop: `code2wav.py`)

A text prompt longer than `prefill_piece_tokens` is prefilled a piece per Thinker iteration, each
between two decode steps of the others, so a long prompt holds their text for one piece at most.

Back from the Talker to the Thinker: `Progress` (a frame was spoken: a Thinker held at its text lead may
go on) and `Spoken` (the audio has ended: so does the text); the messages are `handoff.py`'s. Audio
comes before text (`pacing.py`): the Thinker keeps within a few tokens of the voice while the audio is
not yet well ahead of real time, and Code2Wav decodes a smaller chunk early rather than let the audio run
dry.

A request is held by all three stages; the last stage to let go of it posts `DoneOut` to the session,
after everything else it sent. A failing stage fails only the requests of the failing call.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

from omni_rt.config import EngineSettings
from omni_rt.errors import EngineClosedError, EngineStalledError, OmniRtError, StageError
from omni_rt.model.config import TokenIds
from omni_rt.pipeline.code2wav import Code2WavLoop
from omni_rt.pipeline.handoff import Admit, Stop
from omni_rt.pipeline.inbox import Inbox, InboxClosed
from omni_rt.pipeline.request import (
    DoneOut,
    ErrorOut,
    Message,
    Request,
)
from omni_rt.pipeline.stages import Code2WavStage, TalkerStage, ThinkerStage
from omni_rt.pipeline.talker import TalkerLoop
from omni_rt.pipeline.thinker import ThinkerLoop, YieldRecord  # noqa: F401 - the log's record type
from omni_rt.pipeline.watchdog import StallWatch


@dataclass(frozen=True)
class StepRecord:
    """One stage call, for tests and the benchmark: which requests, when (pipeline clock)."""

    stage: str
    kind: str  # thinker: prefill/piece/decode; talker: prefix/last/step/predict; code2wav: chunk
    t_start: float
    t_end: float
    request_ids: tuple[str, ...]


class Pipeline:
    log_limit = 20000  # records kept in `steps` and in `yields`; past it, the older half is dropped

    def __init__(
        self,
        thinker: ThinkerStage,
        talker: TalkerStage,
        code2wav: Code2WavStage,
        settings: EngineSettings,
        ids: TokenIds,
        clock: Callable[[], float] = time.perf_counter,
        thread_init: Callable[[], None] | None = None,
    ) -> None:
        self.thinker, self.talker, self.code2wav = thinker, talker, code2wav
        self.settings, self.ids, self.clock = settings, ids, clock
        self.thread_init = thread_init  # run first in each stage thread (the engine's CPU thread count)
        self.thinker_inbox = Inbox("thinker")
        self.talker_inbox = Inbox("talker")
        self.code2wav_inbox = Inbox("code2wav")
        self._text = ThinkerLoop(self)
        self._voice = TalkerLoop(self)
        self._audio = Code2WavLoop(self)
        self._frame0 = threading.Condition()  # the Talker notifies it when a frame 0 leaves
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._inflight: set[Request] = set()  # submitted, not done yet
        self._text_waiting: set[Request] = set()  # held at max_text_lead until the Talker catches up
        self._stopping = False
        self.running = False
        self.stall: EngineStalledError | None = None  # set once a stage call has not returned in time
        t = settings.stall_timeout_s
        self._watch = StallWatch(t, self._stalled, clock) if t is not None else None
        self.steps: list[StepRecord] = []  # bounded: see _log
        self.yields: list[YieldRecord] = []

    # -- lifecycle -------------------------------------------------------------------------------------

    def start(self) -> None:
        if self.running:
            return
        self._stopping = False
        self._threads = [
            threading.Thread(target=self._run, args=(loop,), name=f"omni-rt-{name}", daemon=True)
            for name, loop in (
                ("thinker", self._text.loop),
                ("talker", self._voice.loop),
                ("code2wav", self._audio.loop),
            )
        ]
        for t in self._threads:
            t.start()
        if self._watch is not None:
            self._watch.start()
        self.running = True

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the stage threads; requests still in flight end failed (EngineClosedError)."""
        if not self.running:
            return
        self._stopping = True
        if self._watch is not None:
            self._watch.stop()
        with self._frame0:
            self._frame0.notify_all()
        for inbox in (self.thinker_inbox, self.talker_inbox, self.code2wav_inbox):
            inbox.close()
        for t in self._threads:
            t.join(timeout if self.stall is None else 1.0)  # a stalled stage never returns: do not wait
        self._threads = []
        self.running = False
        # Whatever a stage never got to (still in an inbox, or held for hand-off) ends here: every
        # response gets its error and done, none hangs.
        self._end_all(EngineClosedError("the engine stopped"))

    def _end_all(self, exc: BaseException) -> None:
        """End every response in flight with `exc` and its done, whatever stage holds it."""
        with self._lock:
            leftover = list(self._inflight)
        for req in leftover:
            self._fail(req, exc)
            for stage in list(req.holders):
                self._release(req, stage)

    def _stalled(self, stage: str, seconds: float) -> None:
        """The watch's verdict (`watchdog.py`): a stage call has not returned. Its thread is stuck inside
        the device, so the responses are ended from here; a stage that comes back later finds them let go."""
        self.stall = EngineStalledError(
            f"the {stage} stage has not returned from its call for {seconds:.0f} s (the device stopped "
            "making progress); restart the process"
        )
        self._end_all(self.stall)

    def _run(self, loop: Callable[[], None]) -> None:
        if self.thread_init is not None:
            self.thread_init()
        loop()

    def _serve(self, stage: str, inbox: Inbox, has_work, iteration, let_go, wake_at=None) -> None:
        """A stage thread's loop over its per-request states (`seqs`: request -> a state with `.req`):
        take every message (sleeping only while `has_work(seqs)` is false, and, with `wake_at`, at most
        until `wake_at(seqs)` on the pipeline clock, when work comes due without a message), then
        `iteration(msgs, seqs)`.
        If an iteration raises (a scheduler bug), every request the stage holds fails and is let go
        (`let_go(state, seqs)`), and the stage keeps serving; at stop they end with EngineClosedError."""
        seqs: dict = {}
        try:
            while True:
                idle = not has_work(seqs)
                due = wake_at(seqs) if idle and wake_at is not None else None
                msgs = inbox.take(block=idle, timeout=None if due is None else max(0.0, due - self.clock()))
                try:
                    with self._watch.busy(stage) if self._watch is not None else nullcontext():
                        iteration(msgs, seqs)
                except Exception as e:
                    for state in list(seqs.values()):
                        self._fail(state.req, self._stage_error(stage, "loop", e))
                        let_go(state, seqs)
        except InboxClosed:
            for state in list(seqs.values()):
                self._fail(state.req, EngineClosedError("the engine stopped"))
                let_go(state, seqs)

    def submit(self, req: Request) -> None:
        if self.stall is not None:
            raise EngineStalledError(str(self.stall))
        if not self.running or self._stopping:
            raise EngineClosedError("the engine is not running: use `async with engine:`")
        with self._lock:
            self._inflight.add(req)
        self.thinker_inbox.put(Admit(req))

    def cancel(self, req: Request) -> None:
        """Stop a request at every stage's next step (within one codec frame)."""
        with req.lock:
            req.cancelled = True
        self._stop_everywhere(req)

    def fail(self, req: Request, exc: BaseException) -> None:
        """End `req` with `exc` (its error event and done), and stop it at every stage: a session's own
        verdict on its response (e.g. the caller stopped reading its events)."""
        self._fail(req, exc)

    # -- helpers ---------------------------------------------------------------------------------------

    def _stop_everywhere(self, req: Request) -> None:
        """Tell every stage that `req` stopped: each lets go of it, even one that never saw it."""
        for inbox in (self.thinker_inbox, self.talker_inbox, self.code2wav_inbox):
            inbox.put(Stop(req))
        self._clear_frame0(req)

    def _post(self, req: Request, msg: Message) -> None:
        if req.t_done is not None and not isinstance(msg, DoneOut):
            return  # the response is over: a stage call that returns after a stall posts nothing more
        try:
            req.sink(msg)
        except Exception as e:  # the session is gone or cannot keep up: stop generating for it
            if not isinstance(msg, ErrorOut | DoneOut):
                self._fail(req, e)

    def _fail(self, req: Request, exc: BaseException) -> None:
        with req.lock:
            first = req.error is None
            if first:
                req.error = exc
        if first:
            self._post(req, ErrorOut(exc))
            self._stop_everywhere(req)

    def _release(self, req: Request, stage: str) -> None:
        with req.lock:
            if stage not in req.holders:
                return
            req.holders.discard(stage)
            last = not req.holders
        if stage == "talker" or req.stopped:
            self._clear_frame0(req)
        if last:
            req.t_done = self.clock()
            with self._lock:
                self._inflight.discard(req)
                self._text_waiting.discard(req)
            self._post(req, DoneOut(req.status))

    def _clear_frame0(self, req: Request) -> None:
        with self._frame0:
            if req.frame0_pending:
                req.frame0_pending = False
                self._frame0.notify_all()

    def _record(self, stage: str, kind: str, t0: float, reqs: list[Request]) -> None:
        self._log(self.steps, StepRecord(stage, kind, t0, self.clock(), tuple(r.id for r in reqs)))

    def _log(self, records: list, record: object) -> None:
        records.append(record)
        if len(records) > self.log_limit:  # keep the logs bounded on a long-running engine
            del records[: len(records) // 2]

    @staticmethod
    def _shared_call(batch: list, call) -> tuple[list[tuple[Any, Any]], list[tuple[Any, Exception]]]:
        """`call(batch)`: one stage call for several responses' work (-> a result each); when it raises,
        `call([x])` for each alone, so that a request that fails, fails alone (the batched call keeps
        nothing). -> ((x, result) of those that succeeded, (x, error) of those that failed)."""
        try:
            return list(zip(batch, call(batch), strict=True)), []
        except Exception as e:
            if len(batch) == 1:
                return [], [(batch[0], e)]
        done, failed = [], []
        for x in batch:
            try:
                done.append((x, call([x])[0]))
            except Exception as e:
                failed.append((x, e))
        return done, failed

    def _stage_error(self, stage: str, kind: str, e: Exception) -> OmniRtError:
        if isinstance(e, OmniRtError):
            return e
        err = StageError(f"{stage} {kind} failed: {type(e).__name__}: {e}")
        err.__cause__ = e
        return err
