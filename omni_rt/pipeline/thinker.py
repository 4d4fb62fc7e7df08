"""The Thinker thread of the scheduler: admission, prefill (a long prompt a piece at a time), the batched
decode step, the yield to a pending frame 0, the text lead, the hand-off of tokens to the Talker.

Plain Python, as the rest of the scheduler (`scheduler.py` wires this loop to its inbox and shares its
helpers: posting to the session, failing and releasing a request, the step and yield logs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from omni_rt.errors import EngineClosedError
from omni_rt.pipeline.handoff import (
    Admit,
    FirstToken,
    FirstTokenQueued,
    Handoff,
    Prefix,
    Spoken,
    TextEnd,
    TextToken,
)
from omni_rt.pipeline.inbox import InboxClosed
from omni_rt.pipeline.pacing import decode_before_prompt, may_decode_text, text_due
from omni_rt.pipeline.request import Request, TextOut

if TYPE_CHECKING:
    from omni_rt.pipeline.scheduler import Pipeline


def _new_prompt(msg: Handoff) -> bool:
    return isinstance(msg, Admit) and not msg.req.stopped


@dataclass(frozen=True)
class YieldRecord:
    """One wait of the Thinker for a pending frame 0."""

    t_start: float
    t_end: float
    woke_by: str  # "frame0" | "cap" | "stop"


class ThinkerLoop:
    """The Thinker stage thread's loop (`loop`), over the pipeline's Thinker stage and inbox."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.p = pipeline
        self._pieces: list[Request] = []  # long prompts being prefilled a piece at a time

    def loop(self) -> None:
        active: list[Request] = []
        held: list[Handoff] = []  # "after_step" hand-off: the previous iteration's messages to the Talker
        try:
            while True:
                # every active request held at its text lead (and no text held for hand-off, which the
                # Talker may be waiting for): sleep until the Talker's progress wakes this thread
                msgs = self.p.thinker_inbox.take(
                    block=not held and not self._pieces and not any(self._due(r) for r in active)
                )
                try:
                    active, held = self._iteration(msgs, active, held)
                except Exception as e:  # a scheduler bug: fail what this stage holds, keep serving
                    # also what this iteration admitted and what waits in `held` (its Talker messages
                    # are lost): the Talker would wait for them forever
                    held_reqs = (
                        active
                        + self._pieces
                        + [m.req for m in msgs if isinstance(m, Admit)]
                        + [m.req for m in held]
                    )
                    self._pieces = []
                    err = self.p._stage_error("thinker", "loop", e)
                    for req in dict.fromkeys(held_reqs):
                        with self.p._lock:
                            live = req in self.p._inflight
                        if live:
                            self.p._fail(req, err)
                            self.p._release(req, "thinker")
                    active, held = [], []
        except InboxClosed:
            for req in active + self._pieces:
                self.p._fail(req, EngineClosedError("the engine stopped"))
                self.p._release(req, "thinker")
            self._pieces = []

    def _iteration(
        self, msgs: list[Handoff], active: list[Request], held: list[Handoff]
    ) -> tuple[list[Request], list[Handoff]]:
        s = self.p.settings
        out: list[Handoff] = []  # messages for the Talker made in this iteration
        for req in [r for r in active if r.stopped]:
            active.remove(req)
            self.p._release(req, "thinker")
        for req in [r for r in self._pieces if r.stopped]:
            self._pieces.remove(req)
            self.p._release(req, "thinker")
        admitted = []
        for m in msgs:
            req = m.req
            if isinstance(
                m, Spoken
            ):  # the Talker has said its last: the spoken text is the reply, so it ends
                if req in active and not req.text_done:
                    req.text_done = True
                    active.remove(req)
                    self.p._release(req, "thinker")
                continue
            if not isinstance(m, Admit):
                continue  # Stop: the request is dropped above or at admission; Progress only wakes this loop
            if req.stopped:
                self.p._release(req, "thinker")
                continue
            if s.talker_overlap_prefill and not req.needs_thinker_hidden:
                self.p.talker_inbox.put(Prefix(req))  # the Talker prefills its prefix meanwhile
            else:
                out.append(Prefix(req))
            admitted.append(req)
        # a long text prompt goes in pieces, one per iteration, between the others' decode steps
        piece = s.prefill_piece_tokens
        long = [
            r for r in admitted if piece and not r.needs_thinker_hidden and len(r.pending_prompt_ids) > piece
        ]
        self._pieces += long
        admitted = [r for r in admitted if r not in long]
        # requests that arrived together prefill together (one weight pass), unless switched off
        for group in [admitted] if s.batch_starts and admitted else [[r] for r in admitted]:
            self._prefill(group, active, out)
        if self._pieces:
            req = self._pieces[0]
            if len(req.pending_prompt_ids) > piece:
                if not self._step("piece", [req], lambda: self.p.thinker.prefill_piece(req, piece)):
                    self._pieces.pop(0)
            else:  # the last piece: it draws the first token
                self._prefill([self._pieces.pop(0)], active, out)

        # Hand off what the prefills made before the decode step (event mode), so the Talker works on
        # frame 0 while the Thinker yields and decodes.
        if s.handoff == "event":
            self._deliver(out)
            out = []

        batch = self._decode_batch(active)
        if batch:
            self._yield_to_talker(batch)
            batch = self._before_prompts(batch)
        if batch:
            done = self._step("decode", batch, lambda: self.p.thinker.decode(batch))
            if done:
                for req, token in zip(batch, done[0], strict=True):
                    self._accept_token(req, token, out)
        for req in active:
            if req.stopped:  # cancelled or failed while this iteration ran
                self.p._release(req, "thinker")
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

    def _prefill(self, group: list[Request], active: list[Request], out: list[Handoff]) -> None:
        """Prefill `group` in one call (what is left of each prompt); each first token is accepted and its
        request joins `active` unless that token ended it."""
        early = {"queued": self._first_queued} if self.p.settings.starts_early else {}
        done = self._step("prefill", group, lambda: self.p.thinker.prefill(group, **early))
        if not done:
            return
        for req, token in zip(group, done[0], strict=True):
            req.t_thinker_first = self.p.clock()
            self._accept_token(req, token, out)
            if not req.text_done:
                active.append(req)

    def _first_queued(self, reqs: list[Request], ready: object) -> None:
        """`early_start` (`ThinkerStage.prefill`'s `queued`): the first tokens of `reqs` are enqueued on the
        device; the Talker may enqueue the text turns' starts behind them (a spoken turn's Talker prefix
        waits for its Thinker hidden states, which come with its first token)."""
        for req in reqs:
            if not req.needs_thinker_hidden and not req.stopped:
                self.p.talker_inbox.put(FirstTokenQueued(req, ready))

    def _step(self, kind: str, reqs: list[Request], call) -> tuple | None:
        """One Thinker call over `reqs`, logged as `kind`: (its result,), or None when it raised, each of
        `reqs` then failed with the error and let go of here."""
        t0 = self.p.clock()
        try:
            result = call()
        except Exception as e:
            for req in reqs:
                self.p._fail(req, self.p._stage_error("thinker", "prefill" if kind == "piece" else kind, e))
                self.p._release(req, "thinker")
            return None
        self.p._record("thinker", kind, t0, reqs)
        return (result,)

    def _due(self, req: Request) -> bool:
        """Audio before text (`pacing.text_due`): does `req` call for a decode step now? One that does not
        goes in `_text_waiting`, and the Talker's frame that makes it due wakes this thread. A stopped
        request is always due: it is released, not decoded."""
        if req.stopped:
            return True
        with self.p._lock:
            if text_due(req, self.p.clock(), self.p.settings):
                self.p._text_waiting.discard(req)
                return True
            self.p._text_waiting.add(req)
            return False

    def _decode_batch(self, active: list[Request]) -> list[Request]:
        """The next decode step's requests: when one is due (`_due`), every one that may decode
        (`pacing.may_decode_text`, which without `text_due_lead` is the same); else none."""
        live = [r for r in active if not r.stopped]
        if not any([self._due(r) for r in live]):  # (each one not due marked waiting)
            return []
        now = self.p.clock()
        with self.p._lock:
            batch = [r for r in live if may_decode_text(r, now, self.p.settings)]
            self.p._text_waiting.difference_update(batch)
        return batch

    def _before_prompts(self, batch: list[Request]) -> list[Request]:
        """Prompts first (`prompt_first_s`): when a new prompt waits in the inbox (it came during this
        iteration's prefill or yield), this step takes only the replies whose text is needed before that
        prompt's prefill (`pacing.decode_before_prompt`); the others go in the step after the prefill,
        which the next iteration runs first."""
        s = self.p.settings
        if s.prompt_first_s is None or not self.p.thinker_inbox.holds(_new_prompt):
            return batch
        now = self.p.clock()
        with self.p._lock:
            return [r for r in batch if decode_before_prompt(r, now, s)]

    def _accept_token(self, req: Request, token: int, out: list[Handoff]) -> None:
        first = not req.tokens
        req.tokens.append(token)
        req.t_thinker_last = self.p.clock()
        self.p._post(req, TextOut(token))
        eos = token == self.p.ids.im_end and not req.ignore_eos
        if not (first and eos):  # an empty reply gets only TextEnd: the Talker has nothing to say
            out.append(FirstToken(req, token) if first else TextToken(req, token))
        # the next decode would write this token at position len(prompt) + len(tokens) - 1
        full = len(req.prompt_ids) + len(req.tokens) > self.p.settings.max_context
        if eos or full or len(req.tokens) >= req.max_output_tokens:
            req.text_done = True
            out.append(TextEnd(req))
            self.p._release(req, "thinker")

    def _deliver(self, msgs: list[Handoff]) -> None:
        for m in msgs:
            if isinstance(m, FirstToken) and self.p.settings.frame0_in_prefill:
                # From here the Talker can make frame 0 with no more text: the Thinker may yield to it.
                with self.p._frame0:
                    m.req.frame0_pending = not m.req.stopped
            self.p.talker_inbox.put(m)

    def _yield_to_talker(self, batch: list[Request]) -> None:
        """Let a pending frame 0 go first: wait for it (or for the first PCM chunk, `yield_until`), at most
        `yield_to_talker_ms`, on a Condition."""
        cap = self.p.settings.yield_to_talker_ms / 1000.0
        if cap <= 0:
            return
        with self.p._frame0:
            # one wait per response, the step right after its first token: those with an outcome are done
            for r in batch:  # its first token is out and so is its first audio (or frame 0): no wait
                if r.yield_outcome is None and not r.frame0_pending and r.tokens:
                    r.yield_outcome = "not_needed"
            waiting = [r for r in batch if r.frame0_pending and r.yield_outcome is None]
            if not waiting:
                return
            t0 = self.p.clock()
            deadline = t0 + cap
            woke_by = "frame0"
            while any(r.frame0_pending for r in waiting):
                if self.p._stopping:
                    woke_by = "stop"
                    break
                left = deadline - self.p.clock()
                if left <= 0:
                    woke_by = "cap"
                    break
                self.p._frame0.wait(left)  # notified when a frame 0 leaves the Talker
            self.p._log(self.p.yields, YieldRecord(t0, self.p.clock(), woke_by))
            label = "first_audio" if self.p.settings.yield_until == "first_audio" else "frame0"
            for r in waiting:  # each one's own outcome: its audio came, or the wait ended without it
                r.yield_outcome = woke_by if r.frame0_pending else label
