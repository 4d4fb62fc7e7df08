"""The streaming scheduler: three stage threads (Thinker, Talker, Code2Wav) joined by inboxes.

Plain Python: it moves token ids, codes and PCM between stage runners (see `stages.py`) and applies the
pipeline's policy; it never touches tensors. Every hand-off is a message that wakes the receiver through
a Condition (`Inbox`); nothing sleeps on a timer or polls.

    Thinker thread   admit → prefill → first token ─┬─ text deltas → session
                     (wait ≤ yield_to_talker_ms for a pending frame 0) → batched decode step → ...
                                                    ▼ "first", "text", "text_end"
    Talker thread    prefix prefill (during the Thinker prefill) → last position at the first token →
                     code 0 → code predictor → frame 0 → one frame per next text token (batched)
                                                    ▼ "frame", "end"
    Code2Wav thread  chunks of 1, 2, 4, ... frames → exact streaming decode → PCM → session
                     (its loop: `code2wav.py`)

A text prompt longer than `prefill_piece_tokens` is prefilled a piece per Thinker iteration, each
between two decode steps of the others, so a long prompt holds their text for one piece at most.

Back from the Talker to the Thinker: "progress" (a frame was spoken: a Thinker held at its text lead may
go on) and "spoken" (the audio has ended: so does the text). Audio comes before text (`pacing.py`): the
Thinker keeps within a few tokens of the voice while the audio is not yet well ahead of real time, and
Code2Wav decodes a smaller chunk early rather than let the audio run dry.

A request is held by all three stages; the last stage to let go of it posts `DoneOut` to the session,
after everything else it sent. A failing stage fails only the requests of the failing call.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from omni_rt.config import EngineSettings
from omni_rt.errors import EngineClosedError, OmniRtError, StageError
from omni_rt.model.config import TokenIds
from omni_rt.pipeline.code2wav import Code2WavLoop
from omni_rt.pipeline.inbox import Inbox, InboxClosed
from omni_rt.pipeline.pacing import may_decode_text
from omni_rt.pipeline.request import (
    DoneOut,
    ErrorOut,
    Message,
    Request,
    TextOut,
    TranscriptOut,
)
from omni_rt.pipeline.stages import Code2WavStage, TalkerStage, ThinkerStage


@dataclass(frozen=True)
class StepRecord:
    """One stage call, for tests and the benchmark: which requests, when (pipeline clock)."""

    stage: str
    kind: str  # thinker: prefill/piece/decode; talker: prefix/last/step/predict; code2wav: chunk
    t_start: float
    t_end: float
    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class YieldRecord:
    """One wait of the Thinker for a pending frame 0."""

    t_start: float
    t_end: float
    woke_by: str  # "frame0" | "cap" | "stop"


def talker_text_id(
    tokens: list[int], step: int, text_done: bool, ids: TokenIds, ignore_eos: bool
) -> int | None:
    """The Thinker-vocabulary id the Talker reads at decode step `step` >= 1, or None (wait for text).

    The same rule as `omni_rt.model.talker.talker_text_id` (tests check they agree), restated here so the
    scheduler stays free of torch: step k reads generated token k; the text ends at the first
    `<|im_end|>` (not spoken); then `tts_eos` once, then `tts_pad`.
    """
    n = len(tokens)
    if not ignore_eos:
        for j, tok in enumerate(tokens):
            if tok == ids.im_end:
                n, text_done = j, True
                break
    if step < n:
        return tokens[step]
    if not text_done:
        return None
    return ids.tts_eos if step == max(n, 1) else ids.tts_pad


@dataclass(eq=False)
class _TalkerSeq:
    req: Request
    want_prefix: bool = False
    prefix_done: bool = False
    first: int | None = None
    started: bool = False
    step: int = 1  # next decode step (step k reads text token k)
    text: list[int] = field(default_factory=list)  # text tokens handed over so far
    text_done: bool = False
    code0: int | None = None  # sampled code 0 whose residual codes are not predicted yet
    codes_sampled: int = 0
    last_frame: list[int] | None = None
    done: bool = False


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
        self._audio = Code2WavLoop(self)
        self._frame0 = threading.Condition()  # the Talker notifies it when a frame 0 leaves
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._inflight: set[Request] = set()  # submitted, not done yet
        self._text_waiting: set[Request] = set()  # held at max_text_lead until the Talker catches up
        self._pieces: list[Request] = []  # long prompts being prefilled a piece at a time (Thinker thread)
        self._stopping = False
        self.running = False
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
                ("thinker", self._thinker_loop),
                ("talker", self._talker_loop),
                ("code2wav", self._audio.loop),
            )
        ]
        for t in self._threads:
            t.start()
        self.running = True

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the stage threads; requests still in flight end failed (EngineClosedError)."""
        if not self.running:
            return
        self._stopping = True
        with self._frame0:
            self._frame0.notify_all()
        for inbox in (self.thinker_inbox, self.talker_inbox, self.code2wav_inbox):
            inbox.close()
        for t in self._threads:
            t.join(timeout)
        self._threads = []
        self.running = False
        # Whatever a stage never got to (still in an inbox, or held for hand-off) ends here: every
        # response gets its error and done, none hangs.
        with self._lock:
            leftover = list(self._inflight)
        for req in leftover:
            self._fail(req, EngineClosedError("the engine stopped"))
            for stage in list(req.holders):
                self._release(req, stage)

    def _run(self, loop: Callable[[], None]) -> None:
        if self.thread_init is not None:
            self.thread_init()
        loop()

    def submit(self, req: Request) -> None:
        if not self.running or self._stopping:
            raise EngineClosedError("the engine is not running: use `async with engine:`")
        with self._lock:
            self._inflight.add(req)
        self.thinker_inbox.put(("admit", req))

    def cancel(self, req: Request) -> None:
        """Stop a request at every stage's next step (within one codec frame)."""
        with req.lock:
            req.cancelled = True
        self._stop_everywhere(req)

    # -- helpers ---------------------------------------------------------------------------------------

    def _stop_everywhere(self, req: Request) -> None:
        """Tell every stage that `req` stopped: each lets go of it, even one that never saw it."""
        for inbox in (self.thinker_inbox, self.talker_inbox, self.code2wav_inbox):
            inbox.put(("stop", req))
        self._clear_frame0(req)

    def _post(self, req: Request, msg: Message) -> None:
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

    def _stage_error(self, stage: str, kind: str, e: Exception) -> OmniRtError:
        if isinstance(e, OmniRtError):
            return e
        err = StageError(f"{stage} {kind} failed: {type(e).__name__}: {e}")
        err.__cause__ = e
        return err

    # -- Thinker ---------------------------------------------------------------------------------------

    def _thinker_loop(self) -> None:
        active: list[Request] = []
        held: list[tuple] = []  # "after_step" hand-off: the previous iteration's messages to the Talker
        try:
            while True:
                # every active request held at its text lead (and no text held for hand-off, which the
                # Talker may be waiting for): sleep until the Talker's progress wakes this thread
                msgs = self.thinker_inbox.take(
                    block=not held and not self._pieces and not any(self._may_decode(r) for r in active)
                )
                try:
                    active, held = self._thinker_iteration(msgs, active, held)
                except Exception as e:  # a scheduler bug: fail what this stage holds, keep serving
                    # also what this iteration admitted and what waits in `held` (its Talker messages
                    # are lost): the Talker would wait for them forever
                    held_reqs = (
                        active + self._pieces + [m[1] for m in msgs if m[0] == "admit"] + [m[1] for m in held]
                    )
                    self._pieces = []
                    err = self._stage_error("thinker", "loop", e)
                    for req in dict.fromkeys(held_reqs):
                        with self._lock:
                            live = req in self._inflight
                        if live:
                            self._fail(req, err)
                            self._release(req, "thinker")
                    active, held = [], []
        except InboxClosed:
            for req in active + self._pieces:
                self._fail(req, EngineClosedError("the engine stopped"))
                self._release(req, "thinker")
            self._pieces = []

    def _thinker_iteration(
        self, msgs: list[tuple], active: list[Request], held: list[tuple]
    ) -> tuple[list[Request], list[tuple]]:
        s = self.settings
        out: list[tuple] = []  # messages for the Talker made in this iteration
        for req in [r for r in active if r.stopped]:
            active.remove(req)
            self._release(req, "thinker")
        for req in [r for r in self._pieces if r.stopped]:
            self._pieces.remove(req)
            self._release(req, "thinker")
        admitted = []
        for kind, req in msgs:
            if kind == "spoken":  # the Talker has said its last: the spoken text is the reply, so it ends
                if req in active and not req.text_done:
                    req.text_done = True
                    active.remove(req)
                    self._release(req, "thinker")
                continue
            if kind != "admit":
                continue  # "stop": the request is dropped above or at admission
            if req.stopped:
                self._release(req, "thinker")
                continue
            if s.talker_overlap_prefill and not req.needs_thinker_hidden:
                self.talker_inbox.put(("prefix", req))  # the Talker prefills its prefix meanwhile
            else:
                out.append(("prefix", req))
            admitted.append(req)
        # a long text prompt goes in pieces, one per iteration, between the others' decode steps
        piece = s.prefill_piece_tokens
        long = [
            r for r in admitted if piece and not r.needs_thinker_hidden and len(r.pending_prompt_ids) > piece
        ]
        self._pieces += long
        admitted = [r for r in admitted if r not in long]
        # requests that arrived together prefill together (one weight pass), unless switched off
        together = s.batch_prefill and not s.deterministic
        for group in [admitted] if together and admitted else [[r] for r in admitted]:
            self._prefill(group, active, out)
        if self._pieces:
            req = self._pieces[0]
            if len(req.pending_prompt_ids) > piece:
                t0 = self.clock()
                try:
                    self.thinker.prefill_piece(req, piece)
                except Exception as e:
                    self._pieces.pop(0)
                    self._fail(req, self._stage_error("thinker", "prefill", e))
                    self._release(req, "thinker")
                else:
                    self._record("thinker", "piece", t0, [req])
            else:  # the last piece: it draws the first token
                self._prefill([self._pieces.pop(0)], active, out)

        # Hand off what the prefills made before the decode step (event mode), so the Talker works on
        # frame 0 while the Thinker yields and decodes.
        if s.handoff == "event":
            self._deliver(out)
            out = []

        batch = [r for r in active if not r.stopped and self._may_decode(r)]
        if batch:
            self._yield_to_talker(batch)
            t0 = self.clock()
            try:
                tokens = self.thinker.decode(batch)
            except Exception as e:
                for req in batch:
                    self._fail(req, self._stage_error("thinker", "decode", e))
                    self._release(req, "thinker")
                tokens = []
                batch = []
            else:
                self._record("thinker", "decode", t0, batch)
            for req, token in zip(batch, tokens, strict=True):
                self._accept_token(req, token, out)
        for req in active:
            if req.stopped:  # cancelled or failed while this iteration ran
                self._release(req, "thinker")
        active = [r for r in active if not r.text_done and not r.stopped]

        if s.handoff == "event":
            self._deliver(out)
            return active, []
        # after_step: this iteration's output waits for the next iteration to finish, unless none follows
        self._deliver(held)
        if active:
            return active, out
        self._deliver(out)
        return active, []

    def _prefill(self, group: list[Request], active: list[Request], out: list[tuple]) -> None:
        """Prefill `group` in one call (what is left of each prompt); each first token is accepted and its
        request joins `active` unless that token ended it."""
        t0 = self.clock()
        try:
            tokens = self.thinker.prefill(group)
        except Exception as e:
            for req in group:
                self._fail(req, self._stage_error("thinker", "prefill", e))
                self._release(req, "thinker")
            return
        self._record("thinker", "prefill", t0, group)
        for req, token in zip(group, tokens, strict=True):
            req.t_thinker_first = self.clock()
            self._accept_token(req, token, out)
            if not req.text_done:
                active.append(req)

    def _may_decode(self, req: Request) -> bool:
        """Audio before text (`pacing.may_decode_text`): a request too far ahead of the Talker waits (it
        goes in `_text_waiting`, and the Talker's next frame for it wakes this thread). A stopped request
        never waits: it is released, not decoded."""
        if req.stopped:
            return True
        with self._lock:
            if may_decode_text(req, self.clock(), self.settings):
                self._text_waiting.discard(req)
                return True
            self._text_waiting.add(req)
            return False

    def _accept_token(self, req: Request, token: int, out: list[tuple]) -> None:
        first = not req.tokens
        req.tokens.append(token)
        req.t_thinker_last = self.clock()
        self._post(req, TextOut(token))
        eos = token == self.ids.im_end and not req.ignore_eos
        if not (first and eos):  # an empty reply gets only "text_end": the Talker has nothing to say
            out.append(("first", req, token) if first else ("text", req, token))
        # the next decode would write this token at position len(prompt) + len(tokens) - 1
        full = len(req.prompt_ids) + len(req.tokens) > self.settings.max_context
        if eos or full or len(req.tokens) >= req.max_output_tokens:
            req.text_done = True
            out.append(("text_end", req))
            self._release(req, "thinker")

    def _deliver(self, msgs: list[tuple]) -> None:
        for m in msgs:
            if m[0] == "first" and self.settings.frame0_in_prefill:
                # From here the Talker can make frame 0 with no more text: the Thinker may yield to it.
                with self._frame0:
                    m[1].frame0_pending = not m[1].stopped
            self.talker_inbox.put(m)

    def _yield_to_talker(self, batch: list[Request]) -> None:
        """Let a pending frame 0 go first: wait for it (or for the first PCM chunk, `yield_until`), at most
        `yield_to_talker_ms`, on a Condition."""
        cap = self.settings.yield_to_talker_ms / 1000.0
        if cap <= 0:
            return
        with self._frame0:
            waiting = [r for r in batch if r.frame0_pending and not r.yielded]
            if not waiting:
                return
            for r in waiting:
                r.yielded = True  # one wait per response: the step right after its first token
            t0 = self.clock()
            deadline = t0 + cap
            woke_by = "frame0"
            while any(r.frame0_pending for r in waiting):
                if self._stopping:
                    woke_by = "stop"
                    break
                left = deadline - self.clock()
                if left <= 0:
                    woke_by = "cap"
                    break
                self._frame0.wait(left)  # notified when a frame 0 leaves the Talker
            self._log(self.yields, YieldRecord(t0, self.clock(), woke_by))

    # -- Talker ----------------------------------------------------------------------------------------

    def _talker_loop(self) -> None:
        seqs: dict[Request, _TalkerSeq] = {}
        try:
            while True:
                msgs = self.talker_inbox.take(block=not self._talker_has_work(seqs))
                try:
                    self._talker_iteration(msgs, seqs)
                except Exception as e:
                    for s in list(seqs.values()):
                        self._fail(s.req, self._stage_error("talker", "loop", e))
                        self._talker_drop(s, seqs)
        except InboxClosed:
            for s in list(seqs.values()):
                self._fail(s.req, EngineClosedError("the engine stopped"))
                self._talker_drop(s, seqs)

    def _next_text_id(self, s: _TalkerSeq) -> int | None:
        return talker_text_id(s.text, s.step, s.text_done, self.ids, s.req.ignore_eos)

    def _talker_has_work(self, seqs: dict[Request, _TalkerSeq]) -> bool:
        for s in seqs.values():
            if s.req.stopped:
                return True
            if s.want_prefix and not s.prefix_done:
                return True
            if s.prefix_done and s.first is not None and not s.started:
                return True
            if s.started and not s.done and self._next_text_id(s) is not None:
                return True
        return False

    def _talker_iteration(self, msgs: list[tuple], seqs: dict[Request, _TalkerSeq]) -> None:
        for m in msgs:
            kind, req = m[0], m[1]
            s = seqs.get(req)
            if s is None:
                if "talker" not in req.holders:
                    continue  # already finished here: late text for it
                s = seqs[req] = _TalkerSeq(req)
            if kind == "prefix":
                s.want_prefix = True
            elif kind == "first":
                s.first = m[2]
                s.text.append(m[2])
            elif kind == "text":
                s.text.append(m[2])
            elif kind == "text_end":
                s.text_done = True
        for s in [s for s in seqs.values() if s.req.stopped]:
            self._talker_drop(s, seqs)

        # 1. prompt prefixes (during the Thinker's prefill when overlapped)
        for s in [s for s in seqs.values() if s.want_prefix and not s.prefix_done]:
            t0 = self.clock()
            try:
                self.talker.prefill_prefix(s.req)
            except Exception as e:
                self._fail(s.req, self._stage_error("talker", "prefix prefill", e))
                self._talker_drop(s, seqs)
                continue
            self._record("talker", "prefix", t0, [s.req])
            s.prefix_done = True
            s.req.talker_prefilled = True

        # a reply that is only `<|im_end|>` has nothing to speak (as offline): no Talker work
        for s in [s for s in seqs.values() if s.text_done and s.first is None]:
            self._talker_finish(s, seqs)

        # 2. the last prompt position at the first text token → code 0 (→ frame 0 in the same step)
        starting = [s for s in seqs.values() if s.prefix_done and s.first is not None and not s.started]
        for s in starting:
            t0 = self.clock()
            try:
                code0 = self.talker.prefill_last(s.req, s.first)
            except Exception as e:
                self._fail(s.req, self._stage_error("talker", "prefill", e))
                self._talker_drop(s, seqs)
                continue
            self._record("talker", "last", t0, [s.req])
            s.req.t_talker_first_code = self.clock()
            s.started = True
            self._post(s.req, TranscriptOut(s.first))
            self._take_code0(s, code0, seqs)
        if self.settings.frame0_in_prefill:
            self._predict([s for s in starting if s.code0 is not None], seqs)

        # 3. one batched step for every started sequence whose next text input is there
        ready = []
        for s in seqs.values():
            if s.started and not s.done:
                text_id = self._next_text_id(s)
                if text_id is not None:
                    ready.append((s, text_id))
        if not ready:
            return
        # frame0_in_prefill off: a frame's residual codes come at the start of the next step (stock)
        self._predict([s for s, _ in ready if s.code0 is not None], seqs)
        ready = [(s, t) for s, t in ready if not s.done and s.last_frame is not None]
        if not ready:
            return
        reqs = [s.req for s, _ in ready]
        t0 = self.clock()
        try:
            code0s = self.talker.step(reqs, [s.last_frame for s, _ in ready], [t for _, t in ready])
        except Exception as e:
            for s, _ in ready:
                self._fail(s.req, self._stage_error("talker", "step", e))
                self._talker_drop(s, seqs)
            return
        self._record("talker", "step", t0, reqs)
        for (s, text_id), code0 in zip(ready, code0s, strict=True):
            s.step += 1
            if text_id not in (self.ids.tts_eos, self.ids.tts_pad):
                self._post(s.req, TranscriptOut(text_id))
            self._take_code0(s, code0, seqs)
        if self.settings.frame0_in_prefill:
            self._predict([s for s, _ in ready if s.code0 is not None], seqs)

    def _take_code0(self, s: _TalkerSeq, code0: int, seqs: dict[Request, _TalkerSeq]) -> None:
        if code0 == self.ids.codec_eos and not s.req.ignore_eos:
            self._talker_finish(s, seqs)
            return
        s.code0 = code0
        s.codes_sampled += 1

    def _predict(self, batch: list[_TalkerSeq], seqs: dict[Request, _TalkerSeq]) -> None:
        if not batch:
            return
        reqs = [s.req for s in batch]
        t0 = self.clock()
        try:
            frames = self.talker.predict(reqs, [s.code0 for s in batch])
        except Exception as e:
            for s in batch:
                self._fail(s.req, self._stage_error("talker", "code predictor", e))
                self._talker_drop(s, seqs)
            return
        self._record("talker", "predict", t0, reqs)
        for s, codes in zip(batch, frames, strict=True):
            s.code0 = None
            s.last_frame = codes
            index = s.req.frames
            s.req.frames += 1
            self._text_progress(s.req)
            self.code2wav_inbox.put(("frame", s.req, codes, index))
            if index == 0 and self.settings.yield_until == "frame0":
                self._clear_frame0(s.req)  # wakes a Thinker yielding to this frame
            if s.codes_sampled >= s.req.max_audio_frames:
                self._talker_finish(s, seqs)

    def _text_progress(self, req: Request) -> None:
        """A frame was spoken: wake the Thinker if it holds `req` at its text lead and may go on."""
        with self._lock:
            if req not in self._text_waiting or not may_decode_text(req, self.clock(), self.settings):
                return
            self._text_waiting.discard(req)
        self.thinker_inbox.put(("progress", req))

    def _talker_finish(self, s: _TalkerSeq, seqs: dict[Request, _TalkerSeq]) -> None:
        s.done = True
        seqs.pop(s.req, None)
        self.code2wav_inbox.put(("end", s.req))
        # the audio ended first (codec end, audio cap): text nobody hears stops too; the benchmark's
        # fixed lengths (ignore_eos) keep the Thinker to max_output_tokens
        if not s.text_done and not s.req.ignore_eos:
            self.thinker_inbox.put(("spoken", s.req))
        self._release(s.req, "talker")

    def _talker_drop(self, s: _TalkerSeq, seqs: dict[Request, _TalkerSeq]) -> None:
        s.done = True
        seqs.pop(s.req, None)
        self._release(s.req, "talker")
