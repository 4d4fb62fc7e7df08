"""The real stage runners: each owns its stage's tensors, caches and samplers; the scheduler calls them
with token ids and codes (plain ints) and gets plain ints and numpy PCM back.

Caches are allocated once, when the runners are built at engine start: one slot (row) per session in
the Thinker's and the Talker's KV caches (plus one scratch row that graph capture may write), one
Code2Wav streaming state per slot. The per-token Thinker decode and the per-frame Talker step have
shapes that depend only on the batch size (and, for the Thinker, a power-of-two bucket of the attended
cache length): with `cuda_graphs` on a CUDA device they are captured at engine start, one graph per
shape, and replayed; on the CPU (or with the switch off) the same functions run eagerly.

With `prefill_graphs` on as well, the Thinker's prefill and the Talker's prompt-prefix prefill are
graphed too: the new tokens are right-padded to a length bucket (`EngineSettings.prefill_buckets`) and
`logits_index` picks each row's last real token. The Thinker's prefill graphs take embeddings, so text
turns (embedded just before) and spoken turns (clips scattered in) share them. Padding tokens write k/v at positions at and after the
row's real length, in the row's own slot only; each of those rows is written again by the token that
really lands there before any query reads it (a query at position p reads rows <= p of its slot), so
padding never changes a result. A prefill that would pad past the cache's end runs eagerly, unpadded.

Sampling happens inside each step (graphed with it): `omni_rt.model.sampling.StageSampler` holds every
slot's settings, seed and repetition history in device tensors that the step indexes with its `slots`
input, and draws are keyed by (response seed, stage, position), so a request gets the same choices
alone or in any batch, graphed or eager, and equal to the offline loop's. A step's choices for all its
rows are read back to the host together (`host_ids`): one host sync per step, not one per row.
"""

from __future__ import annotations

import functools

import torch

from omni_rt.admission import CAPTURE_ROWS  # the caches' extra row, which graph capture writes into
from omni_rt.config import EngineSettings
from omni_rt.errors import InvalidRequestError
from omni_rt.model.sampling import StageSampler, codec_suppress_ids, frame_sampler, residual_code_sampling
from omni_rt.model.speech_input import build_speech_input
from omni_rt.model.talker import talker_prompt_last, talker_prompt_prefix, talker_step_input
from omni_rt.pipeline import graphs
from omni_rt.pipeline.code2wav_runner import Code2WavRunner
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
    host_ids,
    kept,
    row_groups,
    stage_call,
    stage_stream,
    to_device,
)


class ThinkerRunner:
    def __init__(self, model, settings: EngineSettings, gate: LaunchGate | None = None) -> None:
        self.thinker = model.thinker
        self.ids = model.cfg.ids
        self.accept_hidden_layer = model.cfg.accept_hidden_layer
        self.audio_encoder = getattr(model.thinker, "audio_tower", None)  # None: no speech input
        self.settings = settings
        self.device = model.device
        self.gate = gate  # told when a prefill is enqueued (the Talker's prefix waits for it)
        self.stream = stage_stream(self.device, priority=0)
        self.scratch = settings.max_sessions  # the extra cache row graph capture writes into
        self.cache = self.thinker.allocate_cache(settings.max_sessions + CAPTURE_ROWS, settings.max_context)
        self.vocab = self.thinker.cfg.vocab_size
        self.sampler = StageSampler("thinker", settings.max_sessions + CAPTURE_ROWS, self.vocab, self.device)
        self._graphs: dict[tuple[int, int], object] = {}  # (batch, kv_len) -> captured decode step
        self._prefill_graphs: dict[tuple[int, int, int], object] = {}  # (batch, padded T, kv_len) -> prefill
        if graphs.graphs_on(settings, self.device):
            self._capture_all()

    def _decode_fn(self, kv_len: int):
        def step(ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
            """ids, positions [B, 1], slots [B] -> the next ids [B] (each keyed by the position it takes)."""
            logits, _ = self.thinker(ids, positions, self.cache, slots, last_only=True, kv_len=kv_len)
            return self.sampler(logits[:, -1], slots, positions[:, 0] + 1)

        return step

    def _decode_parts(self, kv_len: int) -> list:
        """The decode step (`_decode_fn`) as `thinker_graph_segments` functions over consecutive runs of
        layers, for `graphs.capture_chain`: the first takes (ids, positions, slots) and returns (x, cos,
        sin, mask) after its layers, each next one takes those and (ids, positions, slots), the last
        returns the next ids. The same operations in the same order as `_decode_fn`."""
        t = self.thinker
        n = len(t.model.layers)
        parts = min(self.settings.thinker_graph_segments, n)
        if parts == 1:
            return [self._decode_fn(kv_len)]
        bounds = [round(i * n / parts) for i in range(parts + 1)]

        def layers(start: int, stop: int, last: bool):
            def part(*args: torch.Tensor):
                *carried, ids, positions, slots = args
                if carried:
                    x, cos, sin, mask = carried
                else:
                    x = t.embed(ids)
                    cos, sin, mask = t.layer_inputs(positions, positions, kv_len, x.dtype)
                x = t.run_layers(x, cos, sin, mask, self.cache, slots, positions, kv_len, start, stop)
                if not last:
                    return x, cos, sin, mask
                return self.sampler(t.logits(x, last_only=True)[:, -1], slots, positions[:, 0] + 1)

            return part

        return [layers(bounds[i], bounds[i + 1], i == parts - 1) for i in range(parts)]

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
            keys = positions.gather(1, index[:, None])[:, 0] + 1  # [B]: the position the reply starts at
            return self.sampler(logits[:, -1], slots, keys), logits[:, -1], hidden

        return prefill

    @torch.no_grad()
    def _capture_all(self) -> None:
        pool = GraphPool(self.stream)  # captured where they replay: graphs.py
        s = self.settings
        batches = [1] if s.deterministic else batch_buckets(s.max_sessions)
        max_len = self.cache.max_len
        for b in batches:
            for kv_len in kv_buckets(max_len):
                static = (
                    torch.zeros(b, 1, dtype=torch.long, device=self.device),  # ids [B, 1]
                    torch.zeros(b, 1, dtype=torch.long, device=self.device),  # positions [B, 1]
                    torch.full((b,), self.scratch, dtype=torch.long, device=self.device),  # slots [B]
                )
                self._graphs[(b, kv_len)] = graphs.capture_chain(self._decode_parts(kv_len), static, pool)
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
                self._prefill_graphs[(b, t, kv_len)] = graphs.capture_or_eager(
                    self._prefill_fn(kv_len), static, pool
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
    def prefill(self, reqs: list[Request]) -> list[int]:
        try:
            for req in reqs:
                # the repetition penalty covers the whole conversation, as the reference's covers its prompt
                history = to_device(req.prompt_ids, self.device)
                self.sampler.assign(req.slot, req.sampling.thinker, req.seed, history_ids=history)
            first, _ = self._prefill_first(reqs)  # [B]
        finally:
            if self.gate is not None:  # enqueued (or failed): the Talker's prefixes may launch now
                self.gate.open(reqs)
        return host_ids([first])

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
        last = to_device([[r.tokens[-1]] for r in reqs], self.device)  # [B, 1]
        # the last token goes to the position after everything already in the cache
        positions = to_device([[len(r.prompt_ids) + len(r.tokens) - 1] for r in reqs], self.device)  # [B, 1]
        slots = to_device([r.slot for r in reqs], self.device)  # [B]
        kv_len = kv_bucket(max(len(r.prompt_ids) + len(r.tokens) for r in reqs), self.cache.max_len)
        choices = [
            kept(self._decode_step(last[rows], positions[rows], slots[rows], kv_len))  # [b]
            for rows in row_groups(len(reqs), self.settings.deterministic)
        ]
        return host_ids(choices)


class TalkerRunner:
    def __init__(self, model, settings: EngineSettings, gate: LaunchGate | None = None) -> None:
        self.talker = model.talker
        self.gate = gate  # the prefix prefill waits for the request's Thinker prefill to be enqueued
        self.embed_text = model.thinker.embed  # the Talker reads the Thinker's input embeddings
        self.settings = settings
        self.device = model.device
        self.cfg = model.cfg
        self.stream = stage_stream(self.device, priority=-1)
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
        self._last_graphs: dict[tuple[int, int], object] = {}  # (batch, kv_len) -> last prompt position
        self._prefix_graphs: dict[tuple[int, int, int], object] = {}  # (batch, padded T, kv_len) -> prefix
        self._frame_ahead: dict[int, list[int]] = {}  # slot -> frame 0 made in `prefill_last`
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
            for kv_len in kv_buckets(self.cache.max_len):
                static = (
                    torch.zeros(b, groups, dtype=torch.long, device=self.device),  # codes [B, 16]
                    torch.full((b,), self.cfg.ids.tts_pad, dtype=torch.long, device=self.device),  # text [B]
                    torch.zeros(b, 1, dtype=torch.long, device=self.device),  # positions [B, 1]
                    torch.full((b,), self.scratch, dtype=torch.long, device=self.device),  # slots [B]
                )
                self._graphs[(b, kv_len)] = graphs.capture_or_eager(self._step_fn(kv_len), static, pool)
            # a whole frame of the code predictor (15 steps, greedy or sampled per row) as one graph
            static = (
                torch.zeros(b, dtype=torch.long, device=self.device),  # code 0 [B]
                torch.full((b,), self.scratch, dtype=torch.long, device=self.device),  # slots [B]
                torch.zeros(b, dtype=torch.long, device=self.device),  # keys [B]
            )
            self._frame_graphs[b] = graphs.capture_or_eager(self._frame_fn, static, pool)
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
    def prefill_last(self, reqs: list[Request], first_tokens: list[int]) -> list[int]:
        """The last prompt position of responses whose first text tokens are here -> each one's code 0;
        in calls as their prefixes are (`_batches`), read back in one host sync."""
        first = dict(zip(reqs, first_tokens, strict=True))
        groups = self._batches(reqs, self._last_plan)
        values = torch.cat([self._first_position(rows, [first[r] for r in rows]) for rows in groups]).tolist()
        code0 = {}
        for r, v in zip([r for rows in groups for r in rows], values, strict=True):
            if self.settings.frame0_in_prefill:
                self._frame_ahead[r.slot] = v  # frame 0, which `predict` hands out
                v = v[0]
            code0[r] = v
        return [code0[r] for r in reqs]

    def _first_position(self, rows: list[Request], first_tokens: list[int]) -> torch.Tensor:
        """One call of `prefill_last`: code 0 [B], or with `frame0_in_prefill` frame 0's codes [B, 16]."""
        for r in rows:
            self._frame_ahead.pop(r.slot, None)  # one a former request of the slot left (its code 0 was EOS)
        first = to_device(first_tokens, self.device)  # [B]
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
        frame = self._frame_graphs.get(b)
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
            return ahead  # frame 0, predicted in `prefill_last`
        c0 = to_device(code0, self.device)  # [B]
        slots = to_device([r.slot for r in reqs], self.device)  # [B]
        keys = to_device([self._position(r) for r in reqs], self.device)  # [B]
        frames = [
            kept(self._frame(c0[rows], slots[rows], keys[rows]))  # [b, 16]
            for rows in row_groups(len(reqs), self.settings.deterministic)
        ]
        return torch.cat(frames).tolist()

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
        codes = to_device(frames, self.device)  # [B, 16]
        text = to_device(text_ids, self.device)  # [B]
        for r in reqs:
            self._steps[r.slot] += 1
        # step k of a sequence with an L-position prompt writes position L - 1 + k
        pos = [self._position(r) for r in reqs]
        positions = to_device(pos, self.device)[:, None]  # [B, 1]
        slots = to_device([r.slot for r in reqs], self.device)  # [B]
        kv_len = kv_bucket(max(pos) + 1, self.cache.max_len)
        choices = [
            kept(self._step(codes[rows], text[rows], positions[rows], slots[rows], kv_len))  # [b]
            for rows in row_groups(len(reqs), self.settings.deterministic)
        ]
        return host_ids(choices)


def build_runners(model, settings: EngineSettings) -> tuple[ThinkerRunner, TalkerRunner, Code2WavRunner]:
    gate = LaunchGate() if settings.prefill_launch_order and settings.talker_overlap_prefill else None
    return (
        ThinkerRunner(model, settings, gate),
        TalkerRunner(model, settings, gate),
        Code2WavRunner(model, settings),
    )
