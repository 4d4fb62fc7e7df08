"""Logits processing and sampling: the one home of every stage's choice of the next id.

Semantics and order follow transformers' `generate` (the reference): repetition penalty, suppressed
ids, then — only when sampling — temperature, top-k, top-p, and a draw from the softmax. Greedy decoding
applies the repetition penalty and suppression too (the Talker relies on that) but no warpers.

Everything here runs on the device with static shapes and no GPU->CPU sync, so a stage's whole step,
sampling included, can be captured in one CUDA graph:
- settings are per-row tensors [B] (each session of a batch has its own), read from per-slot tables
  that the graph indexes with its `slots` input;
- the repetition history is a static [slots, V] bool "seen" mask, not a growing id list;
- randomness is counter-based: a draw is a pure function of (response seed, stage, step key, vocab id),
  hashed on the device. A seeded response therefore makes the same choices alone, in any batch, in or
  out of a graph, on every replay, and in the offline loop — there is no generator state to carry.

The draw is the exponential race: argmax over v of log p_v - log E_v with E_v = -log U_v ~ Exp(1), an
exact categorical draw from softmax(warped logits) (Gumbel-max); filtered ids are -inf and never win.

On the CPU, a batch whose sampled rows all have a top-k runs the same processing on the top-k survivors
only (`choose_top_k_first`): one `torch.topk` instead of two sorts of the vocabulary, and the hash for k
ids instead of V. Over the Thinker's 152k vocabulary the two sorts were about half of a CPU decode step.
Same survivors, same scores, same uniforms per (seed, stage, key, vocab id), so the same draws; the CPU
has no graph to capture and no device to sync with, so the host may read the batch's largest k there.

    StageSampler(stage, slots, vocab, device, suppress=None, history=True)   per-slot device state
        .assign(slot, stage_sampling, seed, history_ids=None, suppress_extra=())   a new response
        (logits[B, V], slots[B], keys[B]) -> ids[B]                          choose (and observe)
    frame_sampler(sampler, slots, talker_keys) -> SampleFn                   the 15 codes of one frame
    process_logits(logits, rows, seen, suppress) -> (greedy scores, warped scores)
    choose(logits, rows, seed, stage, keys, seen, suppress) -> ids[B]     the next ids (either path)
    uniform_noise(seed[B], stage, keys[B], vocab) -> u[B, V] in (0, 1)
    uniform_noise_at(seed[B], stage, keys[B], ids[B, K]) -> u[B, K]     the same uniforms, at ids only
    codec_suppress_ids(vocab, eos, suppress_eos=False) -> ids the Talker never emits
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import NamedTuple, TypeVar

import numpy as np
import torch

from omni_rt.config import StageSampling
from omni_rt.model.device_ids import to_device

Setting = float | torch.Tensor  # a Python scalar, or a per-row tensor [B]
SampleFn = Callable[[torch.Tensor], torch.Tensor]  # logits [B, V] -> ids [B]

# Each stage draws from its own stream of the response's seed (its step keys overlap the others').
STAGES = {"thinker": 0, "talker": 1, "code_predictor": 2}
# keys of the code predictor: a Talker position times this, plus the code group (0..14)
CODE_KEY_STRIDE = 16
SEED_LIMIT = 2**63  # seeds live in int64 tensors


def check_seed(seed: int) -> int:
    if not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"a sampling seed must be in [0, 2**63), got {seed}")
    return seed


class RowSettings(NamedTuple):
    """Per-row settings of a batch, tensors [B] on the logits' device."""

    temperature: torch.Tensor  # float32
    top_k: torch.Tensor  # int64, 0 = off
    top_p: torch.Tensor  # float32, 1.0 = off
    repetition_penalty: torch.Tensor  # float32
    do_sample: torch.Tensor  # bool

    @classmethod
    def of(cls, settings: Sequence[StageSampling], device: torch.device | str | None = None) -> RowSettings:
        def t(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            t([s.temperature for s in settings], torch.float32),
            t([s.top_k for s in settings], torch.int64),
            t([s.top_p for s in settings], torch.float32),
            t([s.repetition_penalty for s in settings], torch.float32),
            t([s.do_sample for s in settings], torch.bool),
        )


# ---------------------------------------------------------------------------------------------------------
# History and suppression masks


def new_history(batch: int, vocab: int, device: torch.device | str | None = None) -> torch.Tensor:
    """An empty "seen" mask [B, V], bool."""
    return torch.zeros(batch, vocab, dtype=torch.bool, device=device)


def mark_seen(seen: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Marks ids [B] or [B, T] as seen in `seen` [B, V], in place; returns it."""
    ids = ids.view(seen.shape[0], -1)  # [B, T]
    return seen.scatter_(1, ids, True)


def history_from_ids(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """The seen mask [B, V] of ids [B, T] (e.g. the prompt: transformers penalises prompt ids too)."""
    return mark_seen(new_history(ids.shape[0], vocab, ids.device), ids)


def codec_suppress_ids(vocab_size: int, eos_id: int, suppress_eos: bool = False) -> list[int]:
    """The Talker's suppressed ids: every codec special (the top 1024 ids) except EOS, as the reference;
    EOS too when `suppress_eos` (benchmarks at fixed lengths)."""
    ids = [i for i in range(max(vocab_size - 1024, 0), vocab_size) if i != eos_id]
    return ids + [eos_id] if suppress_eos else ids


def suppress_mask(vocab: int, ids: Sequence[int] | torch.Tensor, device: torch.device | str | None = None):
    """A [V] bool mask of ids to suppress (build once, reuse every step)."""
    mask = torch.zeros(vocab, dtype=torch.bool, device=device)
    ids = torch.as_tensor(ids, dtype=torch.long, device=device)
    if ids.numel():
        mask[ids] = True
    return mask


# ---------------------------------------------------------------------------------------------------------
# Processors: [B, V] scores in, [B, V] scores out


def _per_row(value: Setting, like: torch.Tensor) -> Setting:
    """A per-row tensor [B] becomes [B, 1] to broadcast over the vocabulary; scalars pass through."""
    return value.to(like.device).view(-1, 1) if isinstance(value, torch.Tensor) else value


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: Setting) -> torch.Tensor:
    """transformers' RepetitionPenaltyLogitsProcessor: seen ids' positive scores / penalty, negative * penalty."""
    p = _per_row(penalty, logits)
    penalised = torch.where(logits < 0, logits * p, logits / p)
    return torch.where(seen, penalised, logits)


def suppress(logits: torch.Tensor, ids_or_mask: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """transformers' SuppressTokensLogitsProcessor: the given ids (or a [V] / [B, V] bool mask) get -inf."""
    mask = ids_or_mask
    if not (isinstance(mask, torch.Tensor) and mask.dtype == torch.bool):
        mask = suppress_mask(logits.shape[-1], ids_or_mask, logits.device)
    return logits.masked_fill(mask, float("-inf"))


def apply_temperature(logits: torch.Tensor, temperature: Setting) -> torch.Tensor:
    return logits / _per_row(temperature, logits)


def top_k_filter(logits: torch.Tensor, k: int | torch.Tensor) -> torch.Tensor:
    """transformers' TopKLogitsWarper: keep scores >= the k-th largest (ties kept). k = 0 keeps all."""
    vocab = logits.shape[-1]
    if isinstance(k, torch.Tensor):  # per row [B]: k-th value from a sort, 0 = off
        k = k.to(logits.device).view(-1, 1)
        ranked = logits.sort(dim=-1, descending=True).values  # [B, V]
        kth = ranked.gather(1, (k.clamp(1, vocab) - 1))  # [B, 1]
        kth = torch.where(k > 0, kth, torch.full_like(kth, float("-inf")))
        return logits.masked_fill(logits < kth, float("-inf"))
    if k <= 0:
        return logits
    kth = torch.topk(logits, min(k, vocab), dim=-1).values[..., -1:]  # [B, 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: Setting) -> torch.Tensor:
    """transformers' TopPLogitsWarper: keep the smallest set of top tokens whose probability reaches p.

    Tokens whose ascending cumulative probability is <= 1 - p are dropped; the top token always stays.
    p = 1.0 keeps everything (transformers skips the warper then; so does this, also per row).
    """
    if not isinstance(p, torch.Tensor) and p >= 1.0:
        return logits
    pr = _per_row(p, logits)
    ascending, order = logits.sort(dim=-1)  # [B, V]
    cum = ascending.softmax(dim=-1).cumsum(dim=-1)  # [B, V]
    drop = cum <= (1 - pr)
    if isinstance(p, torch.Tensor):
        drop = drop & (pr < 1.0)
    drop[..., -1:] = False  # keep at least one token
    return logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))


def process_logits(
    logits: torch.Tensor,
    rows: RowSettings,
    seen: torch.Tensor | None = None,
    suppress_ids: torch.Tensor | Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores for greedy, scores for sampling), both [B, V] float32, in transformers' processor order.

    The repetition penalty and suppression apply to both; temperature, top-k and top-p to sampling only
    (greedy rows get temperature 1 so that their warped scores stay finite)."""
    scores = greedy_scores(logits, rows, seen, suppress_ids)
    warped = top_p_filter(top_k_filter(_sampling_temperature(scores, rows), rows.top_k), rows.top_p)
    return scores, warped


def greedy_scores(
    logits: torch.Tensor,
    rows: RowSettings,
    seen: torch.Tensor | None = None,
    suppress_ids: torch.Tensor | Sequence[int] | None = None,
) -> torch.Tensor:
    """The processors both modes apply: repetition penalty, then suppression; [B, V] float32."""
    scores = logits.float()
    if seen is not None:
        scores = apply_repetition_penalty(scores, seen, rows.repetition_penalty)
    if suppress_ids is not None:
        scores = suppress(scores, suppress_ids)
    return scores


def _sampling_temperature(scores: torch.Tensor, rows: RowSettings) -> torch.Tensor:
    # greedy rows get temperature 1, so that their warped scores stay finite
    return apply_temperature(
        scores, torch.where(rows.do_sample, rows.temperature, torch.ones_like(rows.temperature))
    )


# ---------------------------------------------------------------------------------------------------------
# Counter-based randomness on the device

_M32 = 0xFFFFFFFF
Ints = TypeVar("Ints", torch.Tensor, np.ndarray, int)  # int64 tensors; on the CPU, numpy int64 or Python ints


def _mix32(h: Ints) -> Ints:
    """murmur3's 32-bit finaliser on uint32 values held in int64 (a bijection with full avalanche).

    Values stay below 2**32, so `>>` is a logical shift; a product may wrap int64, but its low 32 bits,
    all that is kept, are exact (two's complement) on every device, and in numpy (see `_hash_bits`)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def _row_hash(seed: Ints, stage: int, keys: Ints) -> Ints:
    """One 32-bit state per row [B] from (seed, stage, key), each 64-bit word folded in 32 bits at a time."""
    h = _mix32((seed & _M32) ^ 0x9E3779B9)
    h = _mix32(h ^ ((seed >> 32) & _M32))
    h = _mix32(h ^ ((0x632BE5AB * (stage + 1)) & _M32))
    h = _mix32(h ^ (keys & _M32))
    return _mix32(h ^ ((keys >> 32) & _M32))


def uniform_noise_at(seed: torch.Tensor, stage: int, keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """U(0, 1) float32 at vocabulary ids [V] (every row) or [B, K] (per row), a pure function of
    (seed[B], stage, keys[B], vocab id). 23 bits: with 24, the top value (2**24 - 0.5) / 2**24 rounds
    to 1.0 in float32, and E = -log 1 = 0 would win every race."""
    if seed.device.type == "cpu":
        return _cpu_uniform_at(seed.tolist(), stage, keys.tolist(), ids)
    x = _hash_bits(_row_hash(seed, stage, keys), ids)
    return ((x >> 9).float() + 0.5) * (1.0 / (1 << 23))


def _cpu_uniform_at(seeds: list[int], stage: int, keys: list[int], ids: torch.Tensor) -> torch.Tensor:
    """`uniform_noise_at` on the CPU, from the rows' seeds and keys as Python ints. The same integer
    arithmetic on Python ints (each row's state) and numpy arrays: some 60 integer ops per draw on a
    handful of values, each a fraction of a torch op's dispatch cost (a code-predictor frame draws 15
    times). The conversion to float is exact in numpy too: a 23-bit integer, + 0.5, times a power of 2."""
    rows = np.array([_row_hash(a, stage, b) for a, b in zip(seeds, keys, strict=True)], dtype=np.int64)
    x = _hash_bits(rows, ids.numpy())
    return torch.from_numpy(((x >> 9).astype(np.float32) + np.float32(0.5)) * np.float32(1.0 / (1 << 23)))


def _hash_bits(rows: Ints, ids: Ints) -> Ints:
    """The 32 hashed bits of row states [B] (`_row_hash`) and vocab ids [V] or [B, K]: int64 [B, V] or
    [B, K]."""
    x = _mix32(rows[:, None] ^ ((ids * 0x9E3779B9) & _M32))
    return _mix32(x ^ 0x85EBCA77)  # a second round: neighbouring ids differ in a few input bits only


def uniform_noise(seed: torch.Tensor, stage: int, keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """U(0, 1) [B, V] float32 for every vocabulary id (see `uniform_noise_at`)."""
    return uniform_noise_at(seed, stage, keys, torch.arange(vocab, device=seed.device, dtype=torch.int64))


def race(
    warped: torch.Tensor, seed: torch.Tensor, stage: int, keys: torch.Tensor, ids: torch.Tensor | None = None
) -> torch.Tensor:
    """A draw from softmax(warped [B, V]): argmax(warped - log E), E = -log U ~ Exp(1); the index [B].

    `ids` [B, K]: `warped` holds only those vocabulary ids' scores, and the noise is theirs."""
    u = (
        uniform_noise(seed, stage, keys, warped.shape[-1])
        if ids is None
        else uniform_noise_at(seed, stage, keys, ids)
    )
    return gumbel_pick(warped, u)


def gumbel_pick(warped: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The race's winner [B]: argmax(warped - log E) with E = -log u, u the rows' uniforms [B, V]."""
    return (warped - torch.log(-torch.log(u))).argmax(dim=-1)


def choose(
    logits: torch.Tensor,
    rows: RowSettings,
    seed: torch.Tensor,
    stage: int,
    keys: torch.Tensor,
    seen: torch.Tensor | None = None,
    suppress_ids: torch.Tensor | None = None,
    top_k_first: bool | None = None,
) -> torch.Tensor:
    """The next ids [B]: each row greedy or sampled by its own `do_sample`, keyed by (seed, stage, key).

    `top_k_first`: warp and race over the top-k survivors only (`choose_top_k_first`) where every sampled
    row has a top-k; None: on the CPU. False: the whole vocabulary, as on a GPU (static shapes)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got {tuple(logits.shape)}")
    if top_k_first is None:
        top_k_first = logits.device.type == "cpu"
    if top_k_first:
        ids = choose_top_k_first(logits, rows, seed, stage, keys, seen, suppress_ids)
        if ids is not None:
            return ids
    scores, warped = process_logits(logits, rows, seen, suppress_ids)
    return torch.where(rows.do_sample, race(warped, seed, stage, keys), scores.argmax(dim=-1))


def choose_top_k_first(
    logits: torch.Tensor,
    rows: RowSettings,
    seed: torch.Tensor,
    stage: int,
    keys: torch.Tensor,
    seen: torch.Tensor | None = None,
    suppress_ids: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """`choose`'s ids [B], warping and racing only the ids that survive top-k; None if a sampled row has
    no top-k (top-k off: every id may survive, so the whole vocabulary is the candidate set).

    Why it is the same processing: top-k keeps the scores >= the k-th largest, ties included; those are
    exactly the n >= k largest, which one `topk(n)` returns (in descending order), with their vocabulary
    ids. Every other id is -inf after top-k and stays so: top-p and the race only ever see survivors. Top-p
    sorts ascending, and -inf ids contribute 0 to its softmax and cumulative sum, so the survivors'
    ascending sums are the vocabulary's (up to the order of the softmax's sum: an fp32 ulp). The race reads each survivor's own uniform (`uniform_noise_at`)
    and takes its argmax in vocabulary order, so equal race values resolve to the lowest id, as argmax
    over the vocabulary does. Host reads (k, n): the CPU only.
    """
    plan = TopKFirst.of(rows, logits.shape[-1])
    if plan is None:
        return None
    if seen is not None and bool((rows.repetition_penalty == 1.0).all()):
        seen = None  # x * 1 and x / 1 are x: a penalty of 1 (the Thinker's default) changes nothing
    return plan.choose(greedy_scores(logits, rows, seen, suppress_ids), seed.tolist(), stage, keys.tolist())


class TopKFirst(NamedTuple):
    """What `choose_top_k_first` reads on the host about a batch's settings, read once: a frame's 15
    code-predictor draws share their rows' settings (`frame_sampler`), so they read them once, not 15
    times (each read is a few small ops and a sync, on a CPU where a step is mostly op dispatch)."""

    sampled: torch.Tensor  # [B] bool: do_sample
    any_sampled: bool
    all_sampled: bool
    divisor: torch.Tensor | None  # [B, 1] temperature (1 for greedy rows); None: all 1, and x / 1 == x
    k: torch.Tensor  # [B, 1] top-k, at most the vocabulary (1 for greedy rows: their draw is not used)
    k_max: int
    k_uniform: bool  # every row's k is k_max
    top_p: torch.Tensor | None  # [B]; None: every row's is 1.0, where top-p drops nothing

    @classmethod
    def of(cls, rows: RowSettings, vocab: int) -> TopKFirst | None:
        """None if a sampled row has no top-k."""
        sampled = rows.do_sample
        k = torch.where(sampled, rows.top_k, torch.ones_like(rows.top_k))
        if bool((k <= 0).any()):
            return None
        k = k.clamp(max=vocab).view(-1, 1)  # [B, 1]
        k_max = int(k.max())
        temperature = torch.where(sampled, rows.temperature, torch.ones_like(rows.temperature))
        return cls(
            sampled=sampled,
            any_sampled=bool(sampled.any()),
            all_sampled=bool(sampled.all()),
            divisor=None if bool((temperature == 1.0).all()) else temperature.view(-1, 1),
            k=k,
            k_max=k_max,
            k_uniform=bool((k == k_max).all()),
            top_p=None if bool((rows.top_p >= 1.0).all()) else rows.top_p,
        )

    def choose(self, scores: torch.Tensor, seeds: list[int], stage: int, keys: list[int]) -> torch.Tensor:
        """ids [B] from `greedy_scores` [B, V] of rows keyed by (seeds[b], stage, keys[b])."""
        greedy = None if self.all_sampled else scores.argmax(dim=-1)  # [B]
        if not self.any_sampled:
            return greedy
        warped = scores if self.divisor is None else scores / self.divisor  # `apply_temperature`
        top, ids = warped.topk(self.k_max, dim=-1)  # [B, K] descending
        kth = top.gather(1, self.k - 1)  # [B, 1]
        n = int((warped >= kth).sum(dim=-1).max())  # survivors, ties at the k-th score included
        if n > top.shape[1]:
            top, ids = warped.topk(n, dim=-1)
        if n > self.k_max or not self.k_uniform:  # else every one of the k_max largest is >= the k-th
            top = top.masked_fill(top < kth, float("-inf"))  # [B, N]: the top-k filter's survivors
        if self.top_p is not None:
            top = top_p_filter(top, self.top_p)  # [B, N]: and top-p's
        ids, order = ids.sort(dim=-1)  # vocabulary order, for argmax's tie rule
        u = _cpu_uniform_at(seeds, stage, keys, ids)  # [B, N]: `race` at these ids
        pick = gumbel_pick(top.gather(1, order), u)  # [B]
        chosen = ids.gather(1, pick[:, None])[:, 0]
        return chosen if greedy is None else torch.where(self.sampled, chosen, greedy)


# ---------------------------------------------------------------------------------------------------------
# One stage's per-slot state


class StageSampler:
    """One stage's sampling state for every cache slot, on the device, allocated once.

    `assign` gives a slot a new response (its settings, seed and repetition history: a few small
    device writes, no sync); calling the sampler chooses the next ids of a batch of slots and marks
    them seen. Everything a call reads is a persistent tensor indexed by `slots`, so a captured step
    that samples replays with whatever responses the slots hold now. `fused`: small vocabularies (the
    Talker's, the code predictor's) sample in one Triton launch (`omni_rt.kernels.sample`) instead of
    ~100 PyTorch ones; set from outside, as the other kernels are (`engine.apply_kernels`).
    """

    def __init__(
        self,
        stage: str,
        slots: int,
        vocab: int,
        device: torch.device | str = "cpu",
        suppress: Sequence[int] | None = None,
        history: bool = True,
        fused: bool = False,
    ) -> None:
        self.stage = STAGES[stage]
        self.vocab = vocab
        self.device = torch.device(device)
        self.temperature = torch.ones(slots, device=device)
        self.top_k = torch.zeros(slots, dtype=torch.int64, device=device)
        self.top_p = torch.ones(slots, device=device)
        self.repetition_penalty = torch.ones(slots, device=device)
        self.do_sample = torch.zeros(slots, dtype=torch.bool, device=device)
        self.seed = torch.zeros(slots, dtype=torch.int64, device=device)
        self.seen = new_history(slots, vocab, device) if history else None  # [S, V]
        # index_put_ with a Python True copies a host scalar, which a CUDA graph cannot capture
        self._true = torch.ones((), dtype=torch.bool, device=device)
        self._base_suppress = None if suppress is None else suppress_mask(vocab, suppress, device)  # [V]
        self.suppress = None if suppress is None else self._base_suppress.expand(slots, vocab).clone()
        self._fused = None
        if fused:
            from omni_rt.kernels import sample

            self._fused = sample.fused_choose if sample.fits(vocab) else None

    def assign(
        self,
        slot: int,
        s: StageSampling,
        seed: int,
        history_ids: torch.Tensor | None = None,
        suppress_extra: Sequence[int] = (),
    ) -> None:
        """Slot `slot` starts a response: settings `s`, `seed`, history = `history_ids` [T] (or none).

        Every write is a fill: `row[slot] = 0.9` or `row[slot, ids] = True` on a CUDA tensor copies a host
        scalar, a blocking copy that waits for everything queued on the stage's stream. The Talker assigns
        right after launching a prompt prefix, so its thread would wait for the prefix to run, with no other
        conversation's frame launched meanwhile (the likely cause of the prefix call's ~10 ms of host time
        on an H200; docs/performance.md, 2026-12-05 third session)."""
        self.temperature[slot].fill_(s.temperature)
        self.top_k[slot].fill_(s.top_k)
        self.top_p[slot].fill_(s.top_p)
        self.repetition_penalty[slot].fill_(s.repetition_penalty)
        self.do_sample[slot].fill_(s.do_sample)
        self.seed[slot].fill_(check_seed(seed))
        if self.seen is not None:
            self.seen[slot].fill_(False)
            if history_ids is not None and history_ids.numel():
                self.seen[slot].index_fill_(0, history_ids.to(self.device), True)
        if self.suppress is not None:
            self.suppress[slot].copy_(self._base_suppress)
            if suppress_extra:
                self.suppress[slot].index_fill_(0, to_device(list(suppress_extra), self.device), True)

    def rows(self, slots: torch.Tensor) -> RowSettings:
        return RowSettings(
            self.temperature[slots], self.top_k[slots], self.top_p[slots],
            self.repetition_penalty[slots], self.do_sample[slots],
        )  # fmt: skip

    def __call__(
        self, logits: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, key_offset: int = 0
    ) -> torch.Tensor:
        """logits [B, V] of slots [B] at step keys [B] (+ key_offset) -> ids [B], observed in the slots'
        histories."""
        if self._fused is not None:
            return self._fused(logits, slots, keys, self, key_offset)
        if key_offset:
            keys = keys + key_offset
        seen = None if self.seen is None else self.seen[slots]
        supp = None if self.suppress is None else self.suppress[slots]
        ids = choose(logits, self.rows(slots), self.seed[slots], self.stage, keys, seen, supp)
        if self.seen is not None:
            self.seen.index_put_((slots, ids), self._true)
        return ids


def frame_sampler(sampler: StageSampler, slots: torch.Tensor, talker_keys: torch.Tensor) -> SampleFn:
    """The code predictor's `sample` for one frame: call i (code group i + 1) draws with key
    talker_key * CODE_KEY_STRIDE + i. The group index is a Python counter, so a captured frame bakes
    in its 15 keys' offsets and reads the Talker keys from its static input."""
    group = itertools.count()
    base = talker_keys * CODE_KEY_STRIDE
    if sampler.device.type != "cpu" or sampler.seen is not None or sampler.suppress is not None:
        return lambda logits: sampler(logits, slots, base, key_offset=next(group))
    # The CPU, no history or suppression (the code predictor's): what `sampler` would do, with the rows'
    # settings, seeds and keys read once a frame rather than once a draw.
    plan = TopKFirst.of(sampler.rows(slots), sampler.vocab)
    seeds, keys = sampler.seed[slots].tolist(), base.tolist()

    def draw(logits: torch.Tensor) -> torch.Tensor:
        offset = next(group)
        if plan is None or logits.shape[-1] != sampler.vocab:
            return sampler(logits, slots, base, key_offset=offset)
        return plan.choose(logits.float(), seeds, sampler.stage, [k + offset for k in keys])

    return draw


def residual_code_sampling(s: StageSampling) -> StageSampling:
    """The reference's code predictor has no repetition penalty (a fresh sequence every frame)."""
    return s if s.repetition_penalty == 1.0 else s.model_copy(update={"repetition_penalty": 1.0})
