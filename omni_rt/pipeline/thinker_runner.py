"""The Thinker's runner: its KV cache, sampler and graphs (decode per batch and cache-length bucket,
right-padded prefills), fed plain ints by the scheduler's Thinker thread. What all runners share (caches
by slot, graphs, padding, sampling inside the steps): `runners.py`'s docstring.
"""

from __future__ import annotations

import torch

from omni_rt.admission import CAPTURE_ROWS  # the caches' extra row, which graph capture writes into
from omni_rt.config import EngineSettings
from omni_rt.errors import InvalidRequestError
from omni_rt.model.sampling import StageSampler
from omni_rt.model.speech_input import build_speech_input
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
from omni_rt.pipeline.stages import Queued


class ThinkerRunner:
    def __init__(
        self,
        model,
        settings: EngineSettings,
        gate: LaunchGate | None = None,
        start: StartHandoff | None = None,
        activity: StageActivity | None = None,
    ) -> None:
        self.thinker = model.thinker
        # whether its work may be on the GPU (the Talker's runner reads it)
        self.activity = activity or StageActivity()
        self.ids = model.cfg.ids
        self.accept_hidden_layer = model.cfg.accept_hidden_layer
        self.audio_encoder = getattr(model.thinker, "audio_tower", None)  # None: no speech input
        self.settings = settings
        self.device = model.device
        self.gate = gate  # told when a prefill is enqueued (the Talker's prefix waits for it)
        # where `early_start` leaves the first reply ids for the Talker (shared by the engine's runners)
        self.start = start or StartHandoff(
            settings.max_sessions + CAPTURE_ROWS, model.cfg.num_code_groups, self.device
        )
        self.stream = stage_stream(self.device, priority=0)
        self.pinned = settings.pinned_readback
        self.scratch = settings.max_sessions  # the extra cache row graph capture writes into
        self.cache = self.thinker.allocate_cache(settings.max_sessions + CAPTURE_ROWS, settings.max_context)
        self.vocab = self.thinker.cfg.vocab_size
        self.sampler = StageSampler("thinker", settings.max_sessions + CAPTURE_ROWS, self.vocab, self.device)
        self._graphs: dict[tuple[int, int], object] = {}  # (batch, kv_len) -> captured decode step
        self._inputs: dict[int, StepInputs] = {}  # batch -> the decode graphs' inputs (ids, positions, slots)
        self._prefill_graphs: dict[tuple[int, int, int], object] = {}  # (batch, padded T, kv_len) -> prefill
        if graphs.graphs_on(settings, self.device):
            self._capture_all()

    def _decode_fn(self, kv_len: int):
        def step(ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
            """ids, positions [B, 1], slots [B] -> the next ids [B] (each keyed by the position it takes)."""
            logits, _ = self.thinker(ids, positions, self.cache, slots, last_only=True, kv_len=kv_len)
            return self._decode_out(logits, positions, slots)

        return step

    def _decode_out(self, logits: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        return self.sampler(logits[:, -1], slots, positions[:, 0] + 1)

    def _prefill_fn(self, kv_len: int):
        def prefill(embeds: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, index: torch.Tensor):
            """embeds [B, T, H] and positions [B, T] (right-padded), slots [B], index [B] (each row's last
            real token) -> (the first reply ids [B], sampled from the logits [B, V] there; those logits;
            hidden [B, T, H]: hidden_states[accept_hidden_layer], which a speech turn's Talker prefix
            reads, an intermediate, so free for text turns)."""
            logits, hidden = self.thinker(
                None, positions, self.cache, slots, self.accept_hidden_layer,
                inputs_embeds=embeds, logits_index=index, kv_len=kv_len,
            )  # fmt: skip
            return self._prefill_out(logits, hidden, positions, slots, index)

        return prefill

    def _prefill_out(self, logits, hidden, positions: torch.Tensor, slots: torch.Tensor, index: torch.Tensor):
        keys = positions.gather(1, index[:, None])[:, 0] + 1  # [B]: the position the reply starts at
        return self.sampler(logits[:, -1], slots, keys), logits[:, -1], hidden

    def _in_parts(self, kv_len: int, prefill: bool) -> list:
        """The decode step (`_decode_fn`) or the prefill (`_prefill_fn`) as `thinker_graph_segments`
        functions over consecutive runs of its layers, for `graphs.capture_chain`: a launch of a shorter
        graph holds the driver's lock for less time, and its first kernels start sooner. Each part takes
        what the one before returned, (x, cos, sin, mask, hidden), then the step's inputs ((ids, positions,
        slots) or (embeds, positions, slots, index)); the last returns the step's outputs. The prefill is
        also cut at `accept_hidden_layer`, whose output it returns. The same operations in the same order
        as the step in one function (Thinker.forward's parts)."""
        t = self.thinker
        n = len(t.model.layers)
        count = min(self.settings.thinker_graph_segments, n)
        if count == 1:
            return [self._prefill_fn(kv_len) if prefill else self._decode_fn(kv_len)]
        keep = self.accept_hidden_layer if prefill else None  # hidden_states[keep]: 0 = the embeddings
        cuts = {round(i * n / count) for i in range(count + 1)} | ({keep} if keep and keep < n else set())
        bounds = sorted(cuts)
        width = 4 if prefill else 3  # the step's inputs, after what the part before returned

        def layers(start: int, stop: int, last: bool):
            def part(*args: torch.Tensor):
                carried, inputs = args[:-width], args[-width:]
                positions, slots = inputs[1], inputs[2]
                if carried:
                    x, cos, sin, mask, hidden = carried
                else:
                    x = hidden = inputs[0] if prefill else t.embed(inputs[0])
                    cos, sin, mask = t.layer_inputs(positions, positions, kv_len, x.dtype)
                x = t.run_layers(x, cos, sin, mask, self.cache, slots, positions, kv_len, start, stop)
                if stop == keep:
                    hidden = x
                if not last:
                    return x, cos, sin, mask, hidden
                if not prefill:
                    return self._decode_out(t.logits(x, last_only=True), positions, slots)
                if keep == n:  # the reference's last hidden_states entry is after the final norm
                    hidden = t.model.norm(x)
                return self._prefill_out(t.logits(x, logits_index=inputs[3]), hidden, *inputs[1:])

            return part

        return [layers(a, b, b == n) for a, b in zip(bounds, bounds[1:], strict=False)]

    @torch.no_grad()
    def _capture_all(self) -> None:
        pool = GraphPool(self.stream)  # captured where they replay: graphs.py
        s = self.settings
        batches = [1] if s.deterministic else batch_buckets(s.max_sessions)
        max_len = self.cache.max_len
        for b in batches:
            # ids [B, 1], positions [B, 1], slots [B]; padding rows: the scratch slot at position 0
            self._inputs[b] = StepInputs([(b, 1), (b, 1), (b,)], [0, 0, self.scratch], self.device)
            for kv_len in kv_buckets(max_len):
                self._graphs[(b, kv_len)] = graphs.capture_chain(
                    self._in_parts(kv_len, prefill=False), self._inputs[b].tensors, pool
                )
        if not s.prefill_graphs:
            return
        # text and speech turns share these graphs: both enter as embeddings
        width = self.thinker.cfg.hidden_size
        for b in prefill_batches(s.prefill_graph_batches, s.max_sessions, s.batch_starts):
            for t, kv_len in prefill_shapes(s.prefill_buckets, max_len):
                static = (
                    torch.zeros(b, t, width, dtype=self.cache.dtype, device=self.device),  # embeds [B, T, H]
                    torch.arange(t, device=self.device).expand(b, t).contiguous(),  # positions [B, T]
                    torch.full((b,), self.scratch, dtype=torch.long, device=self.device),  # slots [B]
                    torch.full((b,), t - 1, dtype=torch.long, device=self.device),  # index [B]
                )
                self._prefill_graphs[(b, t, kv_len)] = graphs.capture_chain(
                    self._in_parts(kv_len, prefill=True), static, pool
                )

    def _decode_step(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, kv_len: int):
        n = ids.shape[0]
        b = batch_bucket(n, self.settings.max_sessions)
        step = self._graphs.get((b, kv_len))
        if step is None:
            return self._decode_fn(kv_len)(ids, positions, slots)  # [B]
        # rows of padding: the scratch slot at position 0 (its cache row and history are never read)
        return step(pad_rows(ids, b, 0), pad_rows(positions, b, 0), pad_rows(slots, b, self.scratch))[:n]

    @stage_call
    def prefill(self, reqs: list[Request], queued: Queued | None = None) -> list[int]:
        self.activity.begin()
        try:
            for req in reqs:
                # the repetition penalty covers the whole conversation, as the reference's covers its prompt
                history = to_device(req.prompt_ids, self.device)
                self.sampler.assign(req.slot, req.sampling.thinker, req.seed, history_ids=history)
            first, _ = self._prefill_first(reqs)  # [B]
        finally:
            if self.gate is not None:  # enqueued (or failed): the Talker's prefixes may launch now
                self.gate.open(reqs)
        if queued is not None:  # early_start: the Talker may enqueue its start behind this prefill
            slots = to_device([r.slot for r in reqs], self.device)
            queued(reqs, self.start.first_token.publish(slots, first))
        values = host_ids([first], self.pinned)
        self.activity.synced()  # the read-back waited for the prefill
        return values

    def _prefill_first(self, reqs: list[Request]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each request's first reply id after its new prompt tokens [B] and the logits it was drawn
        from [B, V], in order. Text prompts that arrive together run as one right-padded batch; speech
        prompts one at a time."""
        out: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(reqs)
        text = [i for i, r in enumerate(reqs) if not r.audio_features]
        for i, r in enumerate(reqs):
            if r.audio_features:
                out[i] = self._prefill_speech(r)
        groups = self._prefill_groups(text, [reqs[i] for i in text])
        for group in groups:
            if not group:
                continue
            rows = [reqs[i] for i in group]
            first, logits, _ = self._prefill_text(rows, [r.pending_prompt_ids for r in rows])
            for j, i in enumerate(group):
                out[i] = kept(first[j : j + 1]), kept(logits[j : j + 1])
        return torch.cat([o[0] for o in out]), torch.cat([o[1] for o in out])

    def _prefill_groups(self, index: list[int], rows: list[Request]) -> list[list[int]]:
        """`index` (the text rows) as prefill calls: `graphed_batches` of `prefill_graph_batches`."""
        by_index = dict(zip(index, rows, strict=True))

        def plan(ix: list[int]):
            return self._prefill_shape([by_index[i] for i in ix])

        return graphed_batches(index, self.settings.prefill_graph_batches, plan, bool(self._prefill_graphs))

    @stage_call
    def prefill_piece(self, req: Request, n: int) -> None:
        """Write the next `n` tokens of a text request's prompt into its cache, between decode steps (a
        long prompt in pieces). The id the graph draws after them is dropped; the history it marks is
        reset by `prefill`'s `assign`, which draws the reply's first id after the last piece."""
        self.activity.begin()  # and no read-back: busy until the next prefill or decode step's
        self._prefill_text([req], [req.pending_prompt_ids[:n]])
        req.prefilled += n

    def _prefill_text(self, rows: list[Request], ids: list[list[int]]):
        """`ids[j]` fed at row j's `prefill_start`..., right-padded into one call: `_prefill_embeds`."""
        padded = torch.zeros(len(rows), max(len(x) for x in ids), dtype=torch.long)  # [B, t]
        for j, x in enumerate(ids):
            padded[j, : len(x)] = torch.tensor(x)
        embeds = self.thinker.embed(to_device(padded, self.device))
        return self._prefill_embeds(rows, embeds, [len(x) for x in ids])

    def _prefill_shape(
        self, reqs: list[Request], lengths: list[int] | None = None
    ) -> tuple[int, int, object] | None:
        """`batch_prefill_plan` of one right-padded prefill of `lengths` tokens (default: the whole
        pending prompt) of each of `reqs` from its `prefill_start`."""
        if not reqs:
            return None
        lengths = lengths or [len(r.pending_prompt_ids) for r in reqs]
        starts = [r.prefill_start for r in reqs]
        return batch_prefill_plan(
            self._prefill_graphs, starts, lengths, self.settings.prefill_buckets, self.cache.max_len
        )

    def _prefill_embeds(
        self, reqs: list[Request], embeds: torch.Tensor, lengths: list[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`lengths` prompt tokens (default: all pending) of `reqs` as embeddings [B, t, H] (right-padded to
        the longest) in one call from each row's `prefill_start`, padded further to a captured bucket when
        a graph fits: (the id [B] sampled after each row's last real token, the logits [B, V] there,
        hidden [B, T, H]). See the module doc for why the padding never changes a result."""
        lengths = lengths or [len(r.pending_prompt_ids) for r in reqs]
        t, kv_len, graph = self._prefill_shape(reqs, lengths)
        positions = torch.stack([torch.arange(r.prefill_start, r.prefill_start + t) for r in reqs])  # [B, T]
        index = torch.tensor([n - 1 for n in lengths])  # [B]
        slots = torch.tensor([r.slot for r in reqs])  # [B]
        step = graph or self._prefill_fn(kv_len)
        dev = self.device
        return step(right_pad(embeds, t), *(to_device(x, dev) for x in (positions, slots, index)))

    def _encoder(self):
        if self.audio_encoder is None:
            raise InvalidRequestError("this model has no audio encoder (no audio_config): send text")
        return self.audio_encoder

    def _prefill_speech(self, req: Request) -> tuple[torch.Tensor, torch.Tensor]:
        """The turn's new tokens with its clips encoded and scattered into their placeholders -> (the
        first reply id [1], its logits [1, V]).

        Text and audio prompts have plain sequential M-RoPE positions (see model/speech_input.py), so
        the positions are the cache rows. Keeps the Thinker's hidden states (`accept_hidden_layer`) of
        the whole prompt for the Talker, which reads them at the audio positions; rows of earlier turns
        stay zero (the Talker has those positions in its cache already and does not feed them again)."""
        new = req.new_prompt_ids
        x = build_speech_input(
            self.thinker, self._encoder(), new, req.audio_features, self.ids, encoded=req.audio_encoded
        )
        first, logits, hidden = self._prefill_embeds([req], x.inputs_embeds)  # [1], [1, V], [1, T, H]
        full = hidden.new_zeros(len(req.prompt_ids), hidden.shape[-1])  # [P, H]
        if req.carried_hidden is not None:  # earlier turns the Talker has not prefilled yet
            full[: req.carried_hidden.shape[0]] = req.carried_hidden
        full[req.thinker_start :] = hidden[0, : len(new)]  # a copy: a graph's output is reused
        req.thinker_hidden = full
        return kept(first), kept(logits)

    @stage_call
    def decode(self, reqs: list[Request]) -> list[int]:
        self.activity.begin()
        values = self._decode(reqs)
        self.activity.synced()  # the read-back waited for the step
        return values

    def _decode(self, reqs: list[Request]) -> list[int]:
        kv_len = kv_bucket(max(len(r.prompt_ids) + len(r.tokens) for r in reqs), self.cache.max_len)
        # the last token goes to the position after everything already in the cache
        pos = [len(r.prompt_ids) + len(r.tokens) - 1 for r in reqs]
        n = len(reqs)
        b = batch_bucket(n, self.settings.max_sessions)
        graph = self._graphs.get((b, kv_len))
        if graph is not None and not self.settings.deterministic:  # the inputs in one copy (StepInputs)
            inputs = self._inputs[b]
            ids = inputs.fill([[r.tokens[-1] for r in reqs], pos, [r.slot for r in reqs]])
            values = host_ids([graph(*ids)[:n]], self.pinned)
            inputs.read_back()
            return values
        last = to_device([[r.tokens[-1]] for r in reqs], self.device)  # [B, 1]
        positions = to_device([[p] for p in pos], self.device)  # [B, 1]
        slots = to_device([r.slot for r in reqs], self.device)  # [B]
        choices = [
            kept(self._decode_step(last[rows], positions[rows], slots[rows], kv_len))  # [b]
            for rows in row_groups(len(reqs), self.settings.deterministic)
        ]
        return host_ids(choices, self.pinned)
