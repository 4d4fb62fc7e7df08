"""The Talker thread of the scheduler: the prompt prefix, the last prompt position at the first text
token (code 0, then frame 0), both for every response that starts together in one go, then one batched
step plus code-predictor frame per text token.

Plain Python, as the rest of the scheduler (`scheduler.py` wires this loop to its inbox and shares its
helpers). Which text id a step reads is `omni_rt.prompt_layout.talker_text_id`, the model's own rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from omni_rt.pipeline.handoff import (
    AudioEnd,
    FirstToken,
    FirstTokenQueued,
    Frame,
    FrameQueued,
    Handoff,
    Prefix,
    Progress,
    Spoken,
    TextEnd,
    TextToken,
)
from omni_rt.pipeline.pacing import talker_due, talker_due_at, talker_may_step, text_due
from omni_rt.pipeline.request import Request, TranscriptOut
from omni_rt.prompt_layout import talker_text_id

if TYPE_CHECKING:
    from omni_rt.pipeline.scheduler import Pipeline


class TalkerPhase(Enum):
    """Where one response is in the Talker, in this order (a response may skip to DONE at any point)."""

    WAITING = "waiting"  # seen (its text may come), its prompt prefix not asked for yet
    PREFIX = "prefix"  # its prompt prefix is to be prefilled (during the Thinker's prefill when overlapped)
    READY = "ready"  # the prefix is in the cache: the first text token makes code 0 and frame 0
    SPEAKING = "speaking"  # one batched step and code-predictor frame per text token
    DONE = "done"  # finished, failed or cancelled: let go


@dataclass(eq=False)
class TalkerSeq:
    """One response's Talker state: prefix, first token, steps, the text handed over, the pending code 0."""

    req: Request
    phase: TalkerPhase = TalkerPhase.WAITING
    first: int | None = None
    step: int = 1  # next decode step (step k reads text token k)
    text: list[int] = field(default_factory=list)  # text tokens handed over so far
    text_done: bool = False
    code0: int | None = None  # sampled code 0 whose residual codes are not predicted yet
    codes_sampled: int = 0
    last_frame: list[int] | None = None
    first_queued: bool = False  # early_start: the first token is on the device (`first_ready`), not here yet
    first_ready: object = None


class TalkerLoop:
    """The Talker stage thread's loop (`loop`), over the pipeline's Talker stage and inbox."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.p = pipeline

    def loop(self) -> None:
        self.p._serve(
            "talker", self.p.talker_inbox, self._has_work, self._iteration, self._drop, self._wake_at
        )

    def _next_text_id(self, s: TalkerSeq) -> int | None:
        return talker_text_id(s.text, s.step, s.text_done, self.p.ids, s.req.ignore_eos)

    def _has_work(self, seqs: dict[Request, TalkerSeq]) -> bool:
        for s in seqs.values():
            if s.req.stopped:
                return True
            if s.phase is TalkerPhase.PREFIX:
                return True
            if s.phase is TalkerPhase.READY and s.first is not None:
                return True
            if s.phase is TalkerPhase.SPEAKING and self._next_text_id(s) is not None:
                if talker_due(s.req, self.p.clock(), self.p.settings):
                    return True
        return False

    def _wake_at(self, seqs: dict[Request, TalkerSeq]) -> float | None:
        """The earliest time (pipeline clock) a reply whose text is here comes due by the clock alone
        (`talker_audio_lead_s`): nothing else would wake this thread then."""
        times = [
            t for s in seqs.values()
            if s.phase is TalkerPhase.SPEAKING and self._next_text_id(s) is not None
            if (t := talker_due_at(s.req, self.p.settings)) is not None
        ]  # fmt: skip
        return min(times, default=None)

    def _iteration(self, msgs: list[Handoff], seqs: dict[Request, TalkerSeq]) -> None:
        for m in msgs:
            req = m.req
            s = seqs.get(req)
            if s is None:
                if "talker" not in req.holders:
                    continue  # already finished here: late text for it
                s = seqs[req] = TalkerSeq(req)
            if isinstance(m, Prefix) and s.phase is TalkerPhase.WAITING:
                s.phase = TalkerPhase.PREFIX
            elif isinstance(m, FirstTokenQueued):
                s.first_queued, s.first_ready = True, m.ready
            elif isinstance(m, FirstToken):
                s.first = m.token
                s.text.append(m.token)
            elif isinstance(m, TextToken):
                s.text.append(m.token)
            elif isinstance(m, TextEnd):
                s.text_done = True
        for s in [s for s in seqs.values() if s.req.stopped]:
            self._drop(s, seqs)

        # 1. prompt prefixes (during the Thinker's prefill when overlapped), of all that start together
        prefixing = [s for s in seqs.values() if s.phase is TalkerPhase.PREFIX]
        for s, _ in self._each(prefixing, "prefix", "prefix prefill", self.p.talker.prefill_prefix, seqs):
            s.phase = TalkerPhase.READY
            s.req.talker_prefilled = True

        # a reply that is only `<|im_end|>` has nothing to speak (as offline): no Talker work
        for s in [s for s in seqs.values() if s.text_done and s.first is None]:
            self._finish(s, seqs)

        # early_start: the last prompt positions (and frames 0) of those whose first tokens are on the device
        self._queue_starts(seqs)

        # 2. the last prompt position at the first text token → code 0 (→ frame 0 in the same step)
        starting = [s for s in seqs.values() if s.phase is TalkerPhase.READY and s.first is not None]

        def last(reqs: list[Request]) -> list[int]:
            return self.p.talker.prefill_last(reqs, [seqs[r].first for r in reqs])

        started = self._each(starting, "last", "prefill", last, seqs)
        for s, code0 in started:
            s.req.t_talker_first_code = self.p.clock()
            s.phase = TalkerPhase.SPEAKING
            self.p._post(s.req, TranscriptOut(s.first))
            self._take_code0(s, code0, seqs)
        if self.p.settings.frame0_in_prefill:
            self._predict([s for s, _ in started if s.code0 is not None], seqs)

        # 3. one batched step for every started sequence whose next text input is there (and, with
        # talker_audio_lead_s, whose audio is below that lead), when one of them is due
        now, settings = self.p.clock(), self.p.settings
        ready = []
        for s in seqs.values():
            if s.phase is TalkerPhase.SPEAKING and talker_may_step(s.req, now, settings):
                text_id = self._next_text_id(s)
                if text_id is not None:
                    ready.append((s, text_id))
        if not any(talker_due(s.req, now, settings) for s, _ in ready):
            return
        # frame0_in_prefill off: a frame's residual codes come at the start of the next step (stock)
        self._predict([s for s, _ in ready if s.code0 is not None], seqs)
        ready = [(s, t) for s, t in ready if s.phase is TalkerPhase.SPEAKING and s.last_frame is not None]
        if not ready:
            return
        reqs = [s.req for s, _ in ready]
        t0 = self.p.clock()
        try:
            code0s = self.p.talker.step(reqs, [s.last_frame for s, _ in ready], [t for _, t in ready])
        except Exception as e:
            for s, _ in ready:
                self.p._fail(s.req, self.p._stage_error("talker", "step", e))
                self._drop(s, seqs)
            return
        self.p._record("talker", "step", t0, reqs)
        for (s, text_id), code0 in zip(ready, code0s, strict=True):
            s.step += 1
            if text_id not in (self.p.ids.tts_eos, self.p.ids.tts_pad):
                self.p._post(s.req, TranscriptOut(text_id))
            self._take_code0(s, code0, seqs)
        if self.p.settings.frame0_in_prefill:
            self._predict([s for s, _ in ready if s.code0 is not None], seqs)

    def _queue_starts(self, seqs: dict[Request, TalkerSeq]) -> None:
        """`early_start`: enqueue the start (last prompt position, frame 0) of a response whose first
        token is enqueued on the device but not here yet, behind the Thinker's prefill, and tell Code2Wav
        where its frame 0 will be. Only for a response that starts alone, the only one the Talker holds: its
        stream then waits for that prefill, and any other response's work (a step, a start whose first token
        is here, a prefix an earlier prefill's first token needs) would wait with it. Starts that come
        together from one prefill go the usual way too: 8 at once took 57.5 ms to first audio early against
        41.2 the usual way on an H200, one alone 27.5 against 28.3 (docs/performance.md, 2026-12-05). One
        try per response; otherwise its start runs when its first token is here, as without `early_start`."""
        early = [
            s for s in seqs.values() if s.first_queued and s.phase is TalkerPhase.READY and s.first is None
        ]
        for s in early:
            s.first_queued = False
        if len(early) != 1 or len(seqs) != 1:
            return
        ready = early[0].first_ready

        def queue(reqs: list[Request]) -> list[object]:
            return [self.p.talker.queue_last(reqs, ready)] * len(reqs)

        for s, frame_ready in self._each(early, "queue", "prefill", queue, seqs):
            if self.p.settings.frame0_in_prefill:
                self.p.code2wav_inbox.put(FrameQueued(s.req, frame_ready))

    def _each(
        self, batch: list[TalkerSeq], kind: str, what: str, call, seqs: dict[Request, TalkerSeq]
    ) -> list[tuple[TalkerSeq, object]]:
        """`call(reqs)` for the responses that start together, in one go (the runner batches them as its
        graphs allow), recorded as `kind`; a request whose call fails (`what` failed) fails alone
        (`Pipeline._shared_call`). -> (response, its result) for those that succeeded."""
        if not batch:
            return []

        def recorded(part: list[TalkerSeq]) -> list:
            reqs = [s.req for s in part]
            t0 = self.p.clock()
            out = call(reqs)
            self.p._record("talker", kind, t0, reqs)
            return [None] * len(part) if out is None else out

        done, failed = self.p._shared_call(batch, recorded)
        for s, e in failed:
            self.p._fail(s.req, self.p._stage_error("talker", what, e))
            self._drop(s, seqs)
        return done

    def _take_code0(self, s: TalkerSeq, code0: int, seqs: dict[Request, TalkerSeq]) -> None:
        if code0 == self.p.ids.codec_eos and not s.req.ignore_eos:
            self._finish(s, seqs)
            return
        s.code0 = code0
        s.codes_sampled += 1

    def _predict(self, batch: list[TalkerSeq], seqs: dict[Request, TalkerSeq]) -> None:
        if not batch:
            return
        reqs = [s.req for s in batch]
        t0 = self.p.clock()
        try:
            frames = self.p.talker.predict(reqs, [s.code0 for s in batch])
        except Exception as e:
            for s in batch:
                self.p._fail(s.req, self.p._stage_error("talker", "code predictor", e))
                self._drop(s, seqs)
            return
        self.p._record("talker", "predict", t0, reqs)
        for s, codes in zip(batch, frames, strict=True):
            s.code0 = None
            s.last_frame = codes
            index = s.req.frames
            s.req.frames += 1
            self._text_progress(s.req)
            self.p.code2wav_inbox.put(Frame(s.req, codes, index))
            if index == 0 and self.p.settings.yield_until == "frame0":
                self.p._clear_frame0(s.req)  # wakes a Thinker yielding to this frame
            if s.codes_sampled >= s.req.max_audio_frames:
                self._finish(s, seqs)

    def _text_progress(self, req: Request) -> None:
        """A frame was spoken: wake the Thinker if it holds `req` at its text lead and `req` is due now."""
        with self.p._lock:
            if req not in self.p._text_waiting or not text_due(req, self.p.clock(), self.p.settings):
                return
            self.p._text_waiting.discard(req)
        self.p.thinker_inbox.put(Progress(req))

    def _finish(self, s: TalkerSeq, seqs: dict[Request, TalkerSeq]) -> None:
        s.phase = TalkerPhase.DONE
        seqs.pop(s.req, None)
        self.p.code2wav_inbox.put(AudioEnd(s.req))
        # the audio ended first (codec end, audio cap): text nobody hears stops too; the benchmark's
        # fixed lengths (ignore_eos) keep the Thinker to max_output_tokens: one held at its text lead
        # goes on once the Talker has let go (`pacing.may_decode_text`), woken here
        if not s.text_done and not s.req.ignore_eos:
            self.p.thinker_inbox.put(Spoken(s.req))
        self.p._release(s.req, "talker")
        if not s.text_done and s.req.ignore_eos:
            self.p.thinker_inbox.put(Progress(s.req))

    def _drop(self, s: TalkerSeq, seqs: dict[Request, TalkerSeq]) -> None:
        s.phase = TalkerPhase.DONE
        seqs.pop(s.req, None)
        self.p._release(s.req, "talker")
