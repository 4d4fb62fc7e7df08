"""The real stage runners: each owns its stage's tensors, caches and samplers; the scheduler calls them
with token ids and codes (plain ints) and gets plain ints and numpy PCM back.

Caches are allocated once, when the runners are built at engine start: one slot (row) per session in
the Thinker's and the Talker's KV caches (plus one scratch row that graph capture may write), one
Code2Wav streaming state per slot. The per-token Thinker decode and the per-frame Talker step have
shapes that depend only on the batch size (and, for the Thinker, a power-of-two bucket of the attended
cache length): with `cuda_graphs` on a CUDA device they are captured at engine start, one graph per
shape, and replayed; on the CPU (or with the switch off) the same functions run eagerly.

Sampling is the offline loop's (`omni_rt.model.offline.StageSampler`), one sampler per sequence and
stage, so a request gets the same decisions from the same logits however it is batched.
"""

from __future__ import annotations

import functools
import warnings
from contextlib import nullcontext

import numpy as np
import torch

from omni_rt.config import EngineSettings, StageSampling
from omni_rt.errors import InvalidRequestError
from omni_rt.model.code2wav import Code2WavStream
from omni_rt.model.offline import StageSampler, codec_suppressed_ids, stage_generator
from omni_rt.model.sampling import greedy
from omni_rt.model.speech_input import build_speech_input
from omni_rt.model.talker import talker_prompt_last, talker_prompt_prefix, talker_step_input
from omni_rt.pipeline.graphs import GraphPool, capture
from omni_rt.pipeline.request import Request


def _generator(req: Request, stage: str, device: torch.device) -> torch.Generator:
    # Each stage draws from its own generator seeded from the response's seed (as offline does), so a
    # seeded response is reproducible whatever the interleaving of the stages.
    return stage_generator(req.sampling.seed, stage, device)


def kv_bucket(n: int, max_len: int, smallest: int = 256) -> int:
    """Cache rows a step attends over: the next power of two >= n (at least `smallest`), capped at the
    cache length. Few distinct values, so few graphs, and short caches are cheap to attend over."""
    b = smallest
    while b < n:
        b *= 2
    return min(b, max_len)


def kv_buckets(max_len: int) -> list[int]:
    """Every value `kv_bucket` takes for a cache of `max_len` rows (one graph each)."""
    lens = [kv_bucket(1, max_len)]
    while lens[-1] < max_len:
        lens.append(kv_bucket(lens[-1] + 1, max_len))
    return lens


def graphs_on(settings: EngineSettings, device: torch.device) -> bool:
    """Capture CUDA graphs? Only where there is CUDA (the CPU runs the same functions eagerly)."""
    return settings.cuda_graphs and device.type == "cuda"


def _capture(fn, static_inputs, pool):
    """A CUDA graph of `fn`, or `fn` itself if this step cannot be captured (it then runs eagerly)."""
    try:
        return capture(fn, static_inputs, pool=pool)
    except Exception as e:  # e.g. a MoE backend that syncs with the host: eager is still correct
        warnings.warn(f"CUDA graph capture failed, running eagerly: {type(e).__name__}: {e}", stacklevel=2)
        torch.cuda.synchronize()
        return fn


def _stream(device: torch.device, priority: int) -> torch.cuda.Stream | None:
    """A stage's own CUDA stream (None on the CPU). Every stage runs off the legacy default stream,
    which would serialise them; the Talker and Code2Wav get high priority, so that the Thinker's
    weight streaming does not starve the small steps on the path to the first audio."""
    return torch.cuda.Stream(device=device, priority=priority) if device.type == "cuda" else None


def stage_call(fn):
    """A runner method: no autograd, on the runner's stream (`self.stream`) when it has one."""

    @functools.wraps(fn)
    def call(self, *args, **kwargs):
        with torch.no_grad(), torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            return fn(self, *args, **kwargs)

    return call


def _rows(n: int, deterministic: bool) -> list[slice]:
    """Row groups to run: the whole batch, or one row at a time (batch-invariant) when deterministic."""
    return [slice(i, i + 1) for i in range(n)] if deterministic else [slice(0, n)]


class ThinkerRunner:
    def __init__(self, model, settings: EngineSettings) -> None:
        self.thinker = model.thinker
        self.ids = model.cfg.ids
        self.accept_hidden_layer = model.cfg.accept_hidden_layer
        self.audio_encoder = getattr(model.thinker, "audio_tower", None)  # None: no speech input
        self.settings = settings
        self.device = model.device
        self.stream = _stream(self.device, priority=0)
        self.scratch = settings.max_sessions  # the extra cache row graph capture writes into
        self.cache = self.thinker.allocate_cache(settings.max_sessions + 1, settings.max_context)
        self.vocab = self.thinker.cfg.vocab_size
        self._samplers: dict[int, StageSampler] = {}  # slot -> the running request's sampler
        self._graphs: dict[tuple[int, int], object] = {}  # (batch, kv_len) -> captured decode step
        if graphs_on(settings, self.device):
            self._capture_all()

    def _decode_fn(self, kv_len: int):
        def step(ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
            logits, _ = self.thinker(ids, positions, self.cache, slots, last_only=True, kv_len=kv_len)
            return logits[:, -1]  # [B, V]

        return step

    @torch.no_grad()
    def _capture_all(self) -> None:
        pool = GraphPool()
        batches = [1] if self.settings.deterministic else range(1, self.settings.max_sessions + 1)
        for b in batches:
            for kv_len in kv_buckets(self.cache.max_len):
                static = (
                    torch.zeros(b, 1, dtype=torch.long, device=self.device),  # ids [B, 1]
                    torch.zeros(b, 1, dtype=torch.long, device=self.device),  # positions [B, 1]
                    torch.full((b,), self.scratch, dtype=torch.long, device=self.device),  # slots [B]
                )
                self._graphs[(b, kv_len)] = _capture(self._decode_fn(kv_len), static, pool)

    def _decode_step(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, kv_len: int):
        step = self._graphs.get((ids.shape[0], kv_len)) or self._decode_fn(kv_len)
        return step(ids, positions, slots)  # [B, V]

    @stage_call
    def prefill(self, reqs: list[Request]) -> list[int]:
        if any(r.audio_features is not None for r in reqs):  # speech: one at a time, from embeddings
            logits = torch.cat(
                [self._prefill_speech(r) if r.audio_features else self._prefill_one(r) for r in reqs]
            )
        elif len(reqs) == 1:
            logits = self._prefill_one(reqs[0])  # [1, V]
        else:
            logits = self._prefill_padded(reqs)  # [B, V]
        out = []
        for i, req in enumerate(reqs):
            sampler = StageSampler(
                req.sampling.thinker,
                self.vocab,
                device=self.device,
                generator=_generator(req, "thinker", self.device),
            )
            # the repetition penalty covers the whole conversation, as the reference's covers its prompt
            sampler.observe(torch.tensor(req.prompt_ids, dtype=torch.long, device=self.device)[None])
            self._samplers[req.slot] = sampler
            out.append(int(sampler(logits[i : i + 1])))
        return out

    def _prefill_one(self, req: Request) -> torch.Tensor:
        new = torch.tensor(req.new_prompt_ids, dtype=torch.long, device=self.device)[None]  # [1, T]
        t = new.shape[1]
        positions = torch.arange(req.thinker_start, req.thinker_start + t, device=self.device)[None]  # [1, T]
        slots = torch.tensor([req.slot], device=self.device)
        kv_len = kv_bucket(req.thinker_start + t, self.cache.max_len)
        logits, _ = self.thinker(new, positions, self.cache, slots, last_only=True, kv_len=kv_len)
        return logits[:, -1]  # [1, V]

    def _encoder(self):
        if self.audio_encoder is None:
            raise InvalidRequestError("this model has no audio encoder (no audio_config): send text")
        return self.audio_encoder

    def _prefill_speech(self, req: Request) -> torch.Tensor:
        """The turn's new tokens with its clips encoded and scattered into their placeholders: [1, V].

        Text and audio prompts have plain sequential M-RoPE positions (see model/speech_input.py), so
        the positions are the cache rows. Keeps the Thinker's hidden states (`accept_hidden_layer`) of
        the whole prompt for the Talker, which reads them at the audio positions; rows of earlier turns
        stay zero (the Talker has those positions in its cache already and does not feed them again)."""
        new = req.new_prompt_ids
        x = build_speech_input(self.thinker, self._encoder(), new, req.audio_features, self.ids)
        t = len(new)
        positions = torch.arange(req.thinker_start, req.thinker_start + t, device=self.device)[None]  # [1, T]
        slots = torch.tensor([req.slot], device=self.device)
        kv_len = kv_bucket(req.thinker_start + t, self.cache.max_len)
        logits, hidden = self.thinker(
            None, positions, self.cache, slots, self.accept_hidden_layer, last_only=True,
            inputs_embeds=x.inputs_embeds, kv_len=kv_len,
        )  # fmt: skip
        full = hidden.new_zeros(len(req.prompt_ids), hidden.shape[-1])  # [P, H]
        full[req.thinker_start :] = hidden[0]
        req.thinker_hidden = full
        return logits[:, -1]  # [1, V]

    def _prefill_padded(self, reqs: list[Request]) -> torch.Tensor:
        """Several prompts in one call, right-padded to the longest: [B, V] logits of each last token.

        Padding tokens sit after their row's prompt, at positions no real query of this call attends to;
        the junk they write there is overwritten by that row's next tokens before anything reads it.
        Past the cache's end they are clamped to its last row, which no prompt reaches (prompts are
        shorter than the context)."""
        news = [r.new_prompt_ids for r in reqs]
        t = max(len(n) for n in news)
        last = self.cache.max_len - 1
        ids = torch.zeros(len(reqs), t, dtype=torch.long)  # [B, T]
        positions = torch.zeros(len(reqs), t, dtype=torch.long)  # [B, T]
        for i, (r, n) in enumerate(zip(reqs, news, strict=True)):
            ids[i, : len(n)] = torch.tensor(n)
            positions[i] = torch.arange(r.thinker_start, r.thinker_start + t).clamp_max(last)
        slots = torch.tensor([r.slot for r in reqs], device=self.device)  # [B]
        index = torch.tensor([len(n) - 1 for n in news], device=self.device)  # [B]
        kv_len = kv_bucket(int(positions.max()) + 1, self.cache.max_len)  # host tensor: no device sync
        logits, _ = self.thinker(
            ids.to(self.device),
            positions.to(self.device),
            self.cache,
            slots,
            logits_index=index,
            kv_len=kv_len,
        )  # [B, 1, V]
        return logits[:, -1]

    @stage_call
    def decode(self, reqs: list[Request]) -> list[int]:
        last = torch.tensor([[r.tokens[-1]] for r in reqs], device=self.device)  # [B, 1]
        # the last token goes to the position after everything already in the cache
        positions = torch.tensor([[len(r.prompt_ids) + len(r.tokens) - 1] for r in reqs], device=self.device)
        slots = torch.tensor([r.slot for r in reqs], device=self.device)  # [B]
        kv_len = kv_bucket(max(len(r.prompt_ids) + len(r.tokens) for r in reqs), self.cache.max_len)
        out: list[int] = []
        for rows in _rows(len(reqs), self.settings.deterministic):
            logits = self._decode_step(last[rows], positions[rows], slots[rows], kv_len)  # [b, V]
            for i, r in enumerate(reqs[rows]):
                out.append(int(self._samplers[r.slot](logits[i : i + 1])))  # [1, V] -> id
        return out


class TalkerRunner:
    def __init__(self, model, settings: EngineSettings) -> None:
        self.talker = model.talker
        self.embed_text = model.thinker.embed  # the Talker reads the Thinker's input embeddings
        self.settings = settings
        self.device = model.device
        self.cfg = model.cfg
        self.stream = _stream(self.device, priority=-1)
        self.scratch = settings.max_sessions  # the extra cache row graph capture writes into
        self.cache = self.talker.allocate_cache(settings.max_sessions + 1, settings.max_talker_context)
        self.talker.code_predictor.setup_cache(settings.max_sessions)
        vocab = self.cfg.talker.vocab_size
        eos = self.cfg.ids.codec_eos
        self._suppress = codec_suppressed_ids(vocab, eos).to(self.device)
        self._suppress_eos = codec_suppressed_ids(vocab, eos, suppress_eos=True).to(self.device)
        # per slot: prompt length (prefix + last position), steps taken, last hidden, samplers
        self._prompt_len: dict[int, int] = {}
        self._steps: dict[int, int] = {}
        self._hidden: dict[int, torch.Tensor] = {}  # [Ht]
        self._code0: dict[int, StageSampler] = {}
        self._cp_gen: dict[int, torch.Generator] = {}
        self._graphs: dict[tuple[int, int], object] = {}  # (batch, kv_len) -> captured step
        self._greedy_frame: dict[int, object] = {}  # batch -> captured greedy code-predictor frame
        self._last_graphs: dict[int, object] = {}  # kv_len -> captured last prompt position (batch 1)
        self._mm_ids = {self.cfg.ids.audio, self.cfg.ids.image, self.cfg.ids.video}
        if graphs_on(settings, self.device):
            self._capture_all()

    def _step_fn(self, kv_len: int):
        def step(codes: torch.Tensor, text_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor):
            """codes [B, 16], text ids [B], positions [B, 1], slots [B] -> (logits [B, V], hidden [B, Ht])."""
            x = talker_step_input(self.talker, self.embed_text, codes, text_ids)  # [B, Ht]
            logits, hidden = self.talker(
                x[:, None], positions, self.cache, slots, kv_len
            )  # [B, 1, V], [B, 1, Ht]
            return logits[:, -1], hidden[:, -1]

        return step

    @torch.no_grad()
    def _capture_all(self) -> None:
        pool = GraphPool()
        batches = [1] if self.settings.deterministic else range(1, self.settings.max_sessions + 1)
        groups = self.cfg.num_code_groups
        for b in batches:
            for kv_len in kv_buckets(self.cache.max_len):
                static = (
                    torch.zeros(b, groups, dtype=torch.long, device=self.device),  # codes [B, 16]
                    torch.full((b,), self.cfg.ids.tts_pad, dtype=torch.long, device=self.device),  # text [B]
                    torch.zeros(b, 1, dtype=torch.long, device=self.device),  # positions [B, 1]
                    torch.full((b,), self.scratch, dtype=torch.long, device=self.device),  # slots [B]
                )
                self._graphs[(b, kv_len)] = _capture(self._step_fn(kv_len), static, pool)
            # a whole greedy frame of the code predictor (15 steps) as one graph; sampled frames draw
            # from per-request generators, which run eagerly
            hidden = torch.zeros(b, self.cfg.talker.hidden_size, dtype=self.cache.dtype, device=self.device)
            code0 = torch.zeros(b, dtype=torch.long, device=self.device)
            self._greedy_frame[b] = _capture(self._greedy_frame_fn, (hidden, code0), pool)
        # the last prompt position (first text token + codec bos): on the path to the first audio
        for kv_len in kv_buckets(self.cache.max_len):
            static = (
                torch.zeros(1, dtype=torch.long, device=self.device),  # first token [1]
                torch.zeros(1, 1, dtype=torch.long, device=self.device),  # positions [1, 1]
                torch.full((1,), self.scratch, dtype=torch.long, device=self.device),  # slots [1]
            )
            self._last_graphs[kv_len] = _capture(self._last_fn(kv_len), static, pool)

    def _last_fn(self, kv_len: int):
        def last(first: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor):
            """first token [1], positions [1, 1], slots [1] -> (logits [1, V], hidden [1, Ht])."""
            x = talker_prompt_last(self.talker, self.embed_text, first)  # [1, Ht]
            logits, hidden = self.talker(
                x[:, None], positions, self.cache, slots, kv_len
            )  # [1, 1, V], [1, 1, Ht]
            return logits[:, -1], hidden[:, -1]

        return last

    def _greedy_frame_fn(self, hidden: torch.Tensor, code0: torch.Tensor) -> torch.Tensor:
        """hidden [B, Ht], code 0 [B] -> the frame's 16 codes [B, 16], codes 1..15 by argmax."""
        return self.talker.predict_frame(hidden, code0, greedy)

    def prompt_prefix(self, req: Request) -> torch.Tensor:
        """The Talker prompt but its last position, for the whole conversation: [L - 1, Ht].

        Audio positions read the Thinker's hidden states (this turn's, from the Thinker runner); those
        of earlier turns are already in this slot's cache and are not fed again, so zeros stand in."""
        hidden = req.thinker_hidden
        if hidden is None and any(t in self._mm_ids for t in req.prompt_ids):
            hidden = torch.zeros(len(req.prompt_ids), self.cfg.thinker.hidden_size, device=self.device)
        return talker_prompt_prefix(self.talker, self.embed_text, req.prompt_ids, req.speaker_id, hidden)

    @stage_call
    def prefill_prefix(self, req: Request) -> None:
        prefix = self.prompt_prefix(req)  # [L - 1, Ht]
        start = req.talker_start  # earlier turns' user tokens are already in this slot's cache
        positions = torch.arange(start, prefix.shape[0], device=self.device)[None]  # [1, L - 1 - start]
        slots = torch.tensor([req.slot], device=self.device)
        kv_len = kv_bucket(prefix.shape[0], self.cache.max_len)
        self.talker(prefix[start:][None], positions, self.cache, slots, kv_len)
        self._prompt_len[req.slot] = prefix.shape[0] + 1
        self._steps[req.slot] = 0
        vocab = self.cfg.talker.vocab_size
        suppress = self._suppress_eos if req.ignore_eos else self._suppress
        self._code0[req.slot] = StageSampler(
            req.sampling.talker,
            vocab,
            device=self.device,
            suppress=suppress,
            generator=_generator(req, "talker", self.device),
        )
        self._cp_gen[req.slot] = _generator(req, "code_predictor", self.device)

    @stage_call
    def prefill_last(self, req: Request, first_token: int) -> int:
        first = torch.tensor([first_token], device=self.device)
        positions = torch.tensor([[self._prompt_len[req.slot] - 1]], device=self.device)
        slots = torch.tensor([req.slot], device=self.device)
        kv_len = kv_bucket(self._prompt_len[req.slot], self.cache.max_len)
        last = self._last_graphs.get(kv_len) or self._last_fn(kv_len)
        logits, hidden = last(first, positions, slots)  # [1, V], [1, Ht]
        self._hidden[req.slot] = hidden[0].clone()  # a graph's output buffer is reused by its next replay
        return int(self._code0[req.slot](logits))

    @stage_call
    def predict(self, reqs: list[Request], code0: list[int]) -> list[list[int]]:
        hidden = torch.stack([self._hidden[r.slot] for r in reqs])  # [B, Ht]
        c0 = torch.tensor(code0, device=self.device)  # [B]
        out: list[list[int]] = []
        for rows in _rows(len(reqs), self.settings.deterministic):
            batch = reqs[rows]
            graph = self._greedy_frame.get(len(batch))
            if graph is not None and not any(r.sampling.effective_code_predictor.do_sample for r in batch):
                frames = graph(hidden[rows], c0[rows])  # [b, 16]: same argmax as the eager path
            else:
                frames = self.talker.predict_frame(
                    hidden[rows], c0[rows], self._code_sampler(batch)
                )  # [b, 16]
            out += frames.tolist()
        return out

    def _code_sampler(self, reqs: list[Request]):
        """Codes 1..15 of a frame, each row with its request's settings and a fresh history (no penalty)."""
        vocab = self.cfg.code_predictor.vocab_size
        pickers = [
            StageSampler(
                _cp_sampling(r.sampling.effective_code_predictor),
                vocab,
                device=self.device,
                generator=self._cp_gen[r.slot],
            )
            for r in reqs
        ]

        def sample(logits: torch.Tensor) -> torch.Tensor:  # [B, V] -> [B]
            return torch.cat([p(logits[i : i + 1]) for i, p in enumerate(pickers)])

        return sample

    @stage_call
    def step(self, reqs: list[Request], frames: list[list[int]], text_ids: list[int]) -> list[int]:
        codes = torch.tensor(frames, device=self.device)  # [B, 16]
        text = torch.tensor(text_ids, device=self.device)  # [B]
        for r in reqs:
            self._steps[r.slot] += 1
        # step k of a sequence with an L-position prompt writes position L - 1 + k
        pos = [self._prompt_len[r.slot] - 1 + self._steps[r.slot] for r in reqs]
        positions = torch.tensor(pos, device=self.device)[:, None]  # [B, 1]
        slots = torch.tensor([r.slot for r in reqs], device=self.device)  # [B]
        kv_len = kv_bucket(max(pos) + 1, self.cache.max_len)
        out: list[int] = []
        for rows in _rows(len(reqs), self.settings.deterministic):
            step = self._graphs.get((rows.stop - rows.start, kv_len)) or self._step_fn(kv_len)
            logits, hidden = step(codes[rows], text[rows], positions[rows], slots[rows])  # [b, V], [b, Ht]
            for i, r in enumerate(reqs[rows]):
                # a copy: a graph's output buffer is overwritten by its next replay
                self._hidden[r.slot] = hidden[i].clone()
                out.append(int(self._code0[r.slot](logits[i : i + 1])))
        return out


def _cp_sampling(s: StageSampling) -> StageSampling:
    # The reference's code predictor has no repetition penalty (a fresh sequence every frame).
    return s if s.repetition_penalty == 1.0 else s.model_copy(update={"repetition_penalty": 1.0})


class Code2WavRunner:
    """One exact streaming decoder state per session slot. With graphs, one CUDA graph per chunk size
    decodes a shared work state: a slot's state is copied in before the replay and out after it (a few
    MB at real shapes: microseconds), so the graphs need not be captured per slot."""

    def __init__(self, model, settings: EngineSettings) -> None:
        self.code2wav = model.code2wav
        self.device = model.device
        self.samples_per_frame = self.code2wav.samples_per_frame
        self.stream = _stream(self.device, priority=-1)
        self._graphs: dict[int, object] = {}  # chunk frames -> captured decode of the work state
        self._work = None
        if graphs_on(settings, self.device):
            self._capture_all(settings.chunk_sizes())
        # one exact streaming state per session slot, allocated once
        self._streams = [Code2WavStream(self.code2wav, step=self._step) for _ in range(settings.max_sessions)]

    @torch.no_grad()
    def _capture_all(self, chunk_sizes: list[int]) -> None:
        pool = GraphPool()
        self._work = self.code2wav.new_state(1)
        q = self.code2wav.cfg.num_quantizers
        for n in chunk_sizes:
            codes = torch.zeros(1, q, n, dtype=torch.long, device=self.device)  # [1, Q, n]
            self._graphs[n] = _capture(lambda c: self.code2wav.step(c, self._work), (codes,), pool)

    def _step(self, codes: torch.Tensor, state) -> torch.Tensor:
        """`Code2Wav.step` for one stream: codes [1, Q, n] -> wav [1, 1, spf n]; graphed sizes replay."""
        graph = self._graphs.get(codes.shape[-1])
        if graph is None:  # the last chunk of a response can have any size: eager
            return self.code2wav.step(codes, state)
        _copy_state(self._work, state)
        wav = graph(codes)
        _copy_state(state, self._work)
        return wav

    def open(self, req: Request) -> None:
        self._streams[req.slot].reset()

    @stage_call
    def push(self, req: Request, frames: list[list[int]]) -> np.ndarray:
        codes = torch.tensor(frames, device=self.device).T  # [16, n]
        # the Talker's codes are in range by construction: skip the check (a host sync on the GPU)
        return self._streams[req.slot].push(codes, check=False).float().cpu().numpy()

    @stage_call
    def flush(self, req: Request) -> np.ndarray:
        return self._streams[req.slot].flush().float().cpu().numpy()

    def close(self, req: Request) -> None:
        self._streams[req.slot].reset()


def _copy_state(dst, src) -> None:
    """Copy one Code2Wav stream state into another of the same shapes (in place, on the device)."""
    dst.pos.copy_(src.pos)
    dst.k.copy_(src.k)
    dst.v.copy_(src.v)
    dst.key_pos.copy_(src.key_pos)
    for module, buf in dst.conv.items():
        buf.copy_(src.conv[module])


def build_runners(model, settings: EngineSettings) -> tuple[ThinkerRunner, TalkerRunner, Code2WavRunner]:
    return ThinkerRunner(model, settings), TalkerRunner(model, settings), Code2WavRunner(model, settings)
