"""The Talker's runner: its KV cache, the code predictor, their samplers and graphs (step, code-predictor
frame, last prompt position, prompt prefix), fed plain ints by the scheduler's Talker thread. What all
runners share: `runners.py`'s docstring.
"""

from __future__ import annotations

import functools

import torch

from omni_rt.admission import CAPTURE_ROWS  # the caches' extra row, which graph capture writes into
from omni_rt.config import EngineSettings
from omni_rt.model.sampling import StageSampler, codec_suppress_ids, frame_sampler, residual_code_sampling
from omni_rt.model.talker import talker_prompt_last, talker_prompt_prefix, talker_step_input
from omni_rt.pipeline import graphs
from omni_rt.pipeline.graphs import GraphPool
from omni_rt.pipeline.request import Request
from omni_rt.pipeline.shapes import (
    batch_bucket,
    batch_buckets,
    batch_prefill_plan,
    graphed_batches,
    kv_bucket,
    kv_buckets,
    pad_rows,
    prefill_batches,
    prefill_shapes,
    right_pad,
)
from omni_rt.pipeline.stage_device import (
    LaunchGate,
    StageActivity,
    StartHandoff,
    StepInputs,
    host_ids,
    kept,
    row_groups,
    stage_call,
    stage_stream,
    to_device,
)


class TalkerRunner:
    def __init__(
        self,
        model,
        settings: EngineSettings,
        gate: LaunchGate | None = None,
        start: StartHandoff | None = None,
        thinker: StageActivity | None = None,
    ) -> None:
        self.talker = model.talker
        self.thinker = thinker  # whether the Thinker has work on the GPU ('idle' programmatic frames)
        self.gate = gate  # the prefix prefill waits for the request's Thinker prefill to be enqueued
        self.embed_text = model.thinker.embed  # the Talker reads the Thinker's input embeddings
        self.settings = settings
        self.device = model.device
        self.cfg = model.cfg
        self.stream = stage_stream(self.device, priority=-1)
        self.pinned = settings.pinned_readback
        self.scratch = settings.max_sessions  # the extra cache row graph capture writes into
        self.cache = self.talker.allocate_cache(
            settings.max_sessions + CAPTURE_ROWS, settings.max_talker_context
        )
        self.talker.code_predictor.setup_cache(settings.max_sessions)
        slots, vocab = settings.max_sessions + CAPTURE_ROWS, self.cfg.talker.vocab_size
        suppress = codec_suppress_ids(vocab, self.cfg.ids.codec_eos)
        fused = getattr(model, "fused_sampling", False)  # `engine.apply_kernels` sets it
        self.code0 = StageSampler("talker", slots, vocab, self.device, suppress=suppress, fused=fused)
        cp_vocab = self.cfg.code_predictor.vocab_size
        self.residual = StageSampler(
            "code_predictor", slots, cp_vocab, self.device, history=False, fused=fused
        )
        # per slot: prompt length (prefix + last position), steps taken
        self._prompt_len: dict[int, int] = {}
        self._steps: dict[int, int] = {}
        # Each slot's last Talker hidden state [slots, Ht], which its next code-predictor frame reads:
        # written and read by slot inside the steps (graphed with them), so a step of many rows makes
        # no per-row copies on the host's side (each a driver call, which waits while another stage
        # thread's graph launch holds the driver's lock: docs/performance.md, 2026-12-04 (third session)).
        # Padding rows write the scratch row, which no frame reads.
        self._last_hidden = torch.zeros(
            slots, self.cfg.talker.hidden_size, dtype=self.cache.dtype, device=self.device
        )
        self._graphs: dict[tuple[int, int], object] = {}  # (batch, kv_len) -> captured step
        self._frame_graphs: dict[int, object] = {}  # batch -> captured code-predictor frame
        # batch -> the frame captured with programmatic launches, replayed while the Thinker is idle
        self._idle_frame_graphs: dict[int, object] = {}
        self._last_graphs: dict[tuple[int, int], object] = {}  # (batch, kv_len) -> last prompt position
        self._prefix_graphs: dict[tuple[int, int, int], object] = {}  # (batch, padded T, kv_len) -> prefix
        self._frame_ahead: dict[int, list[int]] = {}  # slot -> a frame made ahead (`prefill_last`, `step`)
        self._inputs: dict[int, StepInputs] = {}  # batch -> the step and frame graphs' inputs
        # early_start: the first tokens from the Thinker, frames 0 to Code2Wav, on the device (shared by the
        # engine's runners); and each slot's start enqueued by `queue_last` for its request, on the device
        self.start = start or StartHandoff(slots, self.cfg.num_code_groups, self.device)
        self._queued: dict[int, tuple[Request, torch.Tensor]] = {}
        self._mm_ids = {self.cfg.ids.audio, self.cfg.ids.image, self.cfg.ids.video}
        if graphs.graphs_on(settings, self.device):
            self._capture_all()

    def _step_fn(self, kv_len: int):
        def step(codes: torch.Tensor, text_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor):
            """codes [B, 16], text ids [B], positions [B, 1], slots [B] -> code 0 [B], keyed by the step's
            position (as offline); each slot's hidden state goes to `_last_hidden`."""
            x = talker_step_input(self.talker, self.embed_text, codes, text_ids)  # [B, Ht]
            return self._talker_position(x, positions, slots, kv_len)

        return step

    def _talker_position(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, kv_len: int):
        """One Talker position of each row: inputs x [B, Ht] at positions [B, 1] of slots [B] -> code 0 [B]
        (keyed by the position); each row's hidden state stored at its slot of `_last_hidden`."""
        # logits [B, 1, V], hidden [B, 1, Ht]
        logits, hidden = self.talker(x[:, None], positions, self.cache, slots, kv_len)
        self._last_hidden.index_copy_(0, slots, hidden[:, -1])
        return self.code0(logits[:, -1], slots, positions[:, 0])

    @torch.no_grad()
    def _capture_all(self) -> None:
        pool = GraphPool(self.stream)  # captured where they replay: graphs.py
        batches = [1] if self.settings.deterministic else batch_buckets(self.settings.max_sessions)
        groups = self.cfg.num_code_groups
        for b in batches:
            # the step's codes [B, 16], text ids [B], positions [B, 1], slots [B], then the frame's code 0,
            # slots, keys [B], in one buffer (StepInputs); padding rows: the scratch slot
            pad = (0, self.cfg.ids.tts_pad, 0, self.scratch, 0, self.scratch, 0)
            shapes = [(b, groups), (b,), (b, 1), (b,), (b,), (b,), (b,)]
            self._inputs[b] = StepInputs(shapes, pad, self.device)
            static = self._inputs[b].tensors
            for kv_len in kv_buckets(self.cache.max_len):
                self._graphs[(b, kv_len)] = graphs.capture_or_eager(self._step_fn(kv_len), static[:4], pool)
            # a whole frame of the code predictor (15 steps, greedy or sampled per row) as one graph
            self._frame_graphs[b] = graphs.capture_or_eager(self._frame_fn, static[4:], pool)
            self._capture_idle_frame(b, static[4:], pool)
        # the last prompt position (first text token + codec bos): on the path to the first audio; and
        # the prompt prefix, right-padded as the Thinker's prefill is (see the module doc). Both for the
        # batches the Thinker's prefill graphs have: responses that arrive together start together
        s = self.settings
        width = self.cfg.talker.hidden_size
        for b in prefill_batches(s.prefill_graph_batches, s.max_sessions, s.batch_starts):
            for kv_len in kv_buckets(self.cache.max_len):
                static = (
                    torch.zeros(b, dtype=torch.long, device=self.device),  # first tokens [B]
                    torch.zeros(b, 1, dtype=torch.long, device=self.device),  # positions [B, 1]
                    torch.full((b,), self.scratch, dtype=torch.long, device=self.device),  # slots [B]
                )
                self._last_graphs[(b, kv_len)] = graphs.capture_or_eager(self._last_fn(kv_len), static, pool)
            if not s.prefill_graphs:
                continue
            for t, kv_len in prefill_shapes(s.prefill_buckets, self.cache.max_len):
                static = (
                    torch.zeros(b, t, width, dtype=self.cache.dtype, device=self.device),  # embeds [B, T, Ht]
                    torch.arange(t, device=self.device).expand(b, t).contiguous(),  # positions [B, T]
                    torch.full((b,), self.scratch, dtype=torch.long, device=self.device),  # slots [B]
                )
                self._prefix_graphs[(b, t, kv_len)] = graphs.capture_or_eager(
                    self._prefix_fn(kv_len), static, pool
                )

    def _capture_idle_frame(self, b: int, static, pool: GraphPool) -> None:
        """With `programmatic_launch` 'idle': batch b's frame again, its kernels as programmatic dependent
        launches (`CodeFrame.programmatic`), for `_frame_graph` to replay while the Thinker is idle. Alone
        on the GPU they take a frame lower (2.26 -> 1.89 ms sampled at batch 1, H100); beside the Thinker
        they slow its steps (`EngineSettings.programmatic_launch`)."""
        frame_fn = self.talker.code_predictor.frame_fn
        if self.settings.programmatic_launch != "idle" or not hasattr(frame_fn, "programmatic"):
            return
        if b > frame_fn.programmatic_rows:
            return
        with frame_fn.programmatic() as runs:
            instead = "the plain frame graph serves every frame"
            graph = graphs.capture_or_none(self._frame_fn, static, pool, instead) if runs else None
        if graph is not None:
            self._idle_frame_graphs[b] = graph

    def _frame_graph(self, b: int):
        """Batch bucket b's captured frame: the programmatic one while the Thinker has no work on the GPU
        (if captured), else the plain one; None: not captured (eager)."""
        if self.thinker is not None and not self.thinker.busy and b in self._idle_frame_graphs:
            return self._idle_frame_graphs[b]
        return self._frame_graphs.get(b)

    def _prefix_fn(self, kv_len: int):
        def prefix(embeds: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
            """embeds [B, T, Ht], positions [B, T], slots [B]: writes the cache; -> hidden [B, T, Ht]."""
            return self.talker(embeds, positions, self.cache, slots, kv_len)[1]

        return prefix

    def _last_fn(self, kv_len: int):
        def last(first: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor):
            """first tokens [B], positions [B, 1], slots [B] -> code 0 [B] (hidden: `_last_hidden`)."""
            x = talker_prompt_last(self.talker, self.embed_text, first)  # [B, Ht]
            return self._talker_position(x, positions, slots, kv_len)

        return last

    def _frame_fn(self, code0: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor):
        """code 0 [B], slots [B], keys [B] (the position of the Talker step that made each slot's hidden
        state in `_last_hidden`) -> the frame's 16 codes [B, 16], codes 1..15 greedy or sampled per slot."""
        hidden = self._last_hidden.index_select(0, slots)  # [B, Ht]
        return self.talker.predict_frame(hidden, code0, frame_sampler(self.residual, slots, keys))

    def prompt_prefix(self, req: Request) -> torch.Tensor:
        """The Talker prompt but its last position, for the whole conversation: [L - 1, Ht].

        Audio positions read the Thinker's hidden states (this turn's, from the Thinker runner, and any
        carried from earlier turns the Talker has not prefilled); those of turns already in this slot's
        cache are not fed again, so zeros stand in."""
        hidden = req.thinker_hidden
        if hidden is None and any(t in self._mm_ids for t in req.prompt_ids):
            hidden = torch.zeros(len(req.prompt_ids), self.cfg.thinker.hidden_size, device=self.device)
            if req.carried_hidden is not None:
                hidden[: req.carried_hidden.shape[0]] = req.carried_hidden.to(self.device)
        return talker_prompt_prefix(self.talker, self.embed_text, req.prompt_ids, req.speaker_id, hidden)

    def _batches(self, reqs: list[Request], plan) -> list[list[Request]]:
        """Responses that start together as calls (`graphed_batches` of their `plan`): one at a time
        unless `_batching`."""
        if not self._batching:
            return [[r] for r in reqs]
        return graphed_batches(reqs, self.settings.prefill_graph_batches, plan, bool(self._last_graphs))

    @property
    def _batching(self) -> bool:
        """May responses that start together share a call? As the Thinker's prefills (`batch_starts`),
        and not where graphs are on and only batch 1 has them (`prefill_graph_batches` 1)."""
        s = self.settings
        return s.batch_starts and (not self._last_graphs or s.prefill_graph_batches > 1)

    def _prefix_plan(self, reqs: list[Request], new: dict[Request, torch.Tensor]):
        """`batch_prefill_plan` of one right-padded prefill of `reqs`' new prefix positions."""
        starts, lengths = [r.talker_start for r in reqs], [new[r].shape[0] for r in reqs]
        return batch_prefill_plan(
            self._prefix_graphs, starts, lengths, self.settings.prefill_buckets, self.cache.max_len
        )

    @stage_call
    def prefill_prefix(self, reqs: list[Request]) -> None:
        """The prompt prefixes of responses that start together: each after its Thinker prefill is
        enqueued (`LaunchGate`), or, where they may share calls (`_batching`), all of them after theirs,
        right-padded into as few calls as their graphs allow (`_batches`)."""
        groups = [reqs] if self._batching else [[r] for r in reqs]
        for group in groups:
            if self.gate is not None:
                self.gate.wait(group)  # let the Thinker's prefill go first (see LaunchGate)
            prefix = {r: self.prompt_prefix(r) for r in group}  # [L - 1, Ht] each
            new = {r: prefix[r][r.talker_start :] for r in group}  # earlier turns are in the slot's cache
            for rows in self._batches(group, functools.partial(self._prefix_plan, new=new)):
                t, kv_len, graph = self._prefix_plan(rows, new)
                embeds = torch.stack([right_pad(new[r][None], t)[0] for r in rows])  # [B, T, Ht]
                positions = torch.stack([torch.arange(r.talker_start, r.talker_start + t) for r in rows])
                slots = torch.tensor([r.slot for r in rows])  # [B]
                prefix_fn = graph or self._prefix_fn(kv_len)
                prefix_fn(embeds, to_device(positions, self.device), to_device(slots, self.device))
            for r in group:
                self._prompt_len[r.slot] = prefix[r].shape[0] + 1
                self._steps[r.slot] = 0
                eos = [self.cfg.ids.codec_eos] if r.ignore_eos else []
                self.code0.assign(r.slot, r.sampling.talker, r.seed, suppress_extra=eos)
                code_predictor = residual_code_sampling(r.sampling.effective_code_predictor)
                self.residual.assign(r.slot, code_predictor, r.seed)

    def _last_plan(self, reqs: list[Request]) -> tuple[int, object]:
        """(kv_len, graph or None) of the last prompt position of `reqs` in one call."""
        kv_len = kv_bucket(max(self._prompt_len[r.slot] for r in reqs), self.cache.max_len)
        return kv_len, self._last_graphs.get((len(reqs), kv_len))

    @stage_call
    def queue_last(self, reqs: list[Request], ready: object) -> object:
        """`early_start`: `prefill_last`'s work for `reqs`, enqueued behind the Thinker's prefill (`ready`),
        reading the first tokens it left on the device; kept for `prefill_last`, which reads it back.
        With `frame0_in_prefill`, the frames 0 go on the device for Code2Wav: -> what its stream waits
        for (None without)."""
        slots = to_device([r.slot for r in reqs], self.device)  # [B]
        first = self.start.first_token.read(slots, ready)[:, 0]  # [B]
        row = {r: i for i, r in enumerate(reqs)}
        for rows in self._batches(reqs, self._last_plan):
            part = first if len(rows) == len(reqs) else first[to_device([row[r] for r in rows], self.device)]
            out = self._first_position(rows, part)  # [b] or [b, 16]
            for i, r in enumerate(rows):
                self._queued[r.slot] = (r, out[i])
        if not self.settings.frame0_in_prefill:
            return None
        frames = torch.stack([self._queued[r.slot][1] for r in reqs])  # [B, 16]
        return self.start.frame0.publish(slots, frames)

    @stage_call
    def prefill_last(self, reqs: list[Request], first_tokens: list[int]) -> list[int]:
        """The last prompt position of responses whose first text tokens are here -> each one's code 0;
        in calls as their prefixes are (`_batches`), read back in one host sync. What `queue_last`
        enqueued for a request is read back, not made again."""
        first = dict(zip(reqs, first_tokens, strict=True))
        queued = {r: self._queued.pop(r.slot)[1] for r in reqs if self._queued.get(r.slot, (None,))[0] is r}
        groups = (
            self._batches([r for r in reqs if r not in queued], self._last_plan)
            if len(queued) < len(reqs)
            else []
        )
        outs = [
            self._first_position(rows, to_device([first[r] for r in rows], self.device)) for rows in groups
        ]
        if queued:
            outs.append(torch.stack(list(queued.values())))
        values = host_ids(outs, self.pinned)
        code0 = {}
        for r, v in zip([r for rows in groups for r in rows] + list(queued), values, strict=True):
            if self.settings.frame0_in_prefill:
                self._frame_ahead[r.slot] = v  # frame 0, which `predict` hands out
                v = v[0]
            code0[r] = v
        return [code0[r] for r in reqs]

    def _first_position(self, rows: list[Request], first: torch.Tensor) -> torch.Tensor:
        """One call of `prefill_last` at the first tokens [B] on the device: code 0 [B], or with
        `frame0_in_prefill` frame 0's codes [B, 16]."""
        for r in rows:
            self._frame_ahead.pop(r.slot, None)  # one a former request of the slot left (its code 0 was EOS)
        positions = to_device([[self._prompt_len[r.slot] - 1] for r in rows], self.device)  # [B, 1]
        slots = to_device([r.slot for r in rows], self.device)  # [B]
        kv_len, graph = self._last_plan(rows)
        last = graph or self._last_fn(kv_len)
        code0 = last(first, positions, slots)  # [B]
        if not self.settings.frame0_in_prefill:
            return kept(code0)
        # Frame 0 straight from code 0 on the device: the frame is enqueued before the host reads code 0,
        # so the first frame does not wait for a device round trip and the Python between `prefill_last`
        # and `predict`. `predict` hands it out when the scheduler asks for that code 0 (it does next,
        # unless code 0 is EOS); its draws are keyed, so making it early changes nothing.
        return kept(self._frame(code0, slots, positions[:, 0]))  # [B, 16]

    def _frame(self, code0: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor):
        """One code-predictor frame of a batch [B, 16]: the captured graph of its batch bucket, or eager."""
        n = code0.shape[0]
        b = batch_bucket(n, self.settings.max_sessions)
        frame = self._frame_graph(b)
        if frame is None:
            return self._frame_fn(code0, slots, keys)
        pad = (
            pad_rows(code0, b, 0),
            pad_rows(slots, b, self.scratch),
            pad_rows(keys, b, 0),
        )
        return frame(*pad)[:n]

    def _position(self, req: Request) -> int:
        """The Talker position its last step wrote (the last prompt position before the first step)."""
        return self._prompt_len[req.slot] - 1 + self._steps[req.slot]

    @stage_call
    def predict(self, reqs: list[Request], code0: list[int]) -> list[list[int]]:
        ahead = [self._frame_ahead.pop(r.slot, None) for r in reqs]  # never reused for a later frame
        if all(a is not None and a[0] == c for a, c in zip(ahead, code0, strict=True)):
            return ahead  # predicted in `prefill_last` (frame 0) or in `step` (`frames_in_step`)
        c0 = to_device(code0, self.device)  # [B]
        slots = to_device([r.slot for r in reqs], self.device)  # [B]
        keys = to_device([self._position(r) for r in reqs], self.device)  # [B]
        frames = [
            kept(self._frame(c0[rows], slots[rows], keys[rows]))  # [b, 16]
            for rows in row_groups(len(reqs), self.settings.deterministic)
        ]
        return host_ids(frames, self.pinned)

    def _graphed_step(self, reqs, frames, text_ids, pos, graph, inputs: StepInputs, ahead: bool) -> list[int]:
        """`step` through its batch's graph, the inputs of the step and its frame in one copy: the frame
        (`frames_in_step`) reads the step's code 0 on the device, and both are read back in one sync."""
        slots = [r.slot for r in reqs]
        n = len(reqs)
        static = inputs.fill([frames, text_ids, pos, slots, [], slots, pos])
        code0 = graph(*static[:4])  # [b]
        if not ahead:
            values = host_ids([code0[:n]], self.pinned)
            inputs.read_back()
            return values
        static[4].copy_(code0, non_blocking=True)
        values = host_ids([self._frame_graph(code0.shape[0])(*static[4:])[:n]], self.pinned)  # [n, 16]
        inputs.read_back()
        return self._frames_ahead(reqs, values)

    def _step(self, codes, text, positions, slots, kv_len: int):
        """One Talker step of a batch: the captured graph of its batch bucket, or eager."""
        n = codes.shape[0]
        b = batch_bucket(n, self.settings.max_sessions)
        step = self._graphs.get((b, kv_len))
        if step is None:
            return self._step_fn(kv_len)(codes, text, positions, slots)
        tts_pad = self.cfg.ids.tts_pad
        code0 = step(
            pad_rows(codes, b, 0), pad_rows(text, b, tts_pad), pad_rows(positions, b, 0),
            pad_rows(slots, b, self.scratch),
        )  # fmt: skip
        return code0[:n]

    @stage_call
    def step(self, reqs: list[Request], frames: list[list[int]], text_ids: list[int]) -> list[int]:
        for r in reqs:
            self._steps[r.slot] += 1
        # step k of a sequence with an L-position prompt writes position L - 1 + k
        pos = [self._position(r) for r in reqs]
        kv_len = kv_bucket(max(pos) + 1, self.cache.max_len)
        ahead = self.settings.frames_in_step
        n = len(reqs)
        b = batch_bucket(n, self.settings.max_sessions)
        graph = self._graphs.get((b, kv_len))
        if graph is not None and not self.settings.deterministic:
            return self._graphed_step(reqs, frames, text_ids, pos, graph, self._inputs[b], ahead)
        codes = to_device(frames, self.device)  # [B, 16]
        text = to_device(text_ids, self.device)  # [B]
        positions = to_device(pos, self.device)[:, None]  # [B, 1]
        slots = to_device([r.slot for r in reqs], self.device)  # [B]
        choices = []
        for rows in row_groups(len(reqs), self.settings.deterministic):
            code0 = self._step(codes[rows], text[rows], positions[rows], slots[rows], kv_len)  # [b]
            # `frames_in_step`: the frame straight from code 0 on the device, as `_first_position` makes
            # frame 0; `predict` hands it out (its draws are keyed by the same position)
            choices.append(kept(self._frame(code0, slots[rows], positions[rows, 0]) if ahead else code0))
        values = host_ids(choices, self.pinned)
        return self._frames_ahead(reqs, values) if ahead else values

    def _frames_ahead(self, reqs: list[Request], frames: list[list[int]]) -> list[int]:
        """Keep each step's frame for `predict` to hand out (`frames_in_step`); -> the codes 0."""
        for r, frame in zip(reqs, frames, strict=True):
            self._frame_ahead[r.slot] = frame
        return [frame[0] for frame in frames]
