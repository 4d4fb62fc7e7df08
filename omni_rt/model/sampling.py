"""Logits processing and sampling: small pure functions, no GPU->CPU sync, static shapes.

Semantics and order follow transformers' `generate` (the reference): repetition penalty, suppressed
ids, then — only when sampling — temperature, top-k, top-p, and a draw from the softmax. Greedy decoding
applies the repetition penalty and suppression too (the Talker relies on that) but no warpers.

The repetition history is a static [B, V] bool "seen" mask instead of a growing id list, so a decode
step keeps one shape and can be captured in a CUDA graph. Settings may be Python scalars (one setting
for the batch) or per-row tensors [B] (a batch of sessions with their own settings: `SamplingBatch`).

    SamplingParams(temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=1.0, do_sample=False, seed=None)
    THINKER_DEFAULTS, TALKER_DEFAULTS, CODE_PREDICTOR_DEFAULTS; code_predictor_params(talker_params)
    SamplingBatch.from_params(params: Sequence[SamplingParams], device) (per-row tensors)
    new_history(batch, vocab, device) -> seen[B, V];  history_from_ids(ids[B, T], vocab) -> seen[B, V]
    mark_seen(seen[B, V], ids[B] | ids[B, T]) -> seen (in place)
    suppress_mask(vocab, ids, device) -> mask[V];  codec_suppress_ids(vocab, eos_id) -> list[int]
    apply_repetition_penalty(logits[B, V], seen[B, V], penalty) -> logits
    suppress(logits[B, V], ids_or_mask) -> logits
    apply_temperature(logits, temperature) / top_k_filter(logits, k) / top_p_filter(logits, p) -> logits
    greedy(logits[B, V]) -> ids[B];  sample(logits[B, V], generator) -> ids[B]
    process_logits(logits, params, seen=None, suppress_ids=None) -> (greedy_scores, sample_scores)
    sample_next(logits[B, V], params, seen=None, generator=None, suppress_ids=None) -> ids[B]
        (params: SamplingParams or SamplingBatch; suppress_ids: a [V] bool mask (best: built once) or ids)
    make_generator(seed, device) -> torch.Generator | None
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from omni_rt.errors import ConfigError

Setting = float | torch.Tensor  # a Python scalar, or a per-row tensor [B]


@dataclass(frozen=True)
class SamplingParams:
    """One stage's decoding settings (transformers' names). top_k 0 and top_p 1.0 disable those filters."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    do_sample: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ConfigError(
                f"temperature must be > 0, got {self.temperature} (use do_sample=False for greedy)"
            )
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if not self.repetition_penalty > 0:
            raise ConfigError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")


# The released checkpoint's Thinker generation_config is not available here; greedy is the default.
THINKER_DEFAULTS = SamplingParams(do_sample=False)
# Qwen3OmniMoeForConditionalGeneration.generate(talker_*) defaults.
TALKER_DEFAULTS = SamplingParams(
    temperature=0.9, top_k=50, top_p=1.0, repetition_penalty=1.05, do_sample=True
)
# The reference's code predictor mirrors the Talker's do_sample and, when sampling, uses top_k 50 and
# top_p 0.8 at its default temperature 1.0, without repetition penalty.
CODE_PREDICTOR_DEFAULTS = SamplingParams(temperature=1.0, top_k=50, top_p=0.8, do_sample=True)


def code_predictor_params(talker: SamplingParams) -> SamplingParams:
    """The code predictor's settings for a Talker setting: it follows the Talker's do_sample and seed."""
    return SamplingParams(
        temperature=CODE_PREDICTOR_DEFAULTS.temperature,
        top_k=CODE_PREDICTOR_DEFAULTS.top_k,
        top_p=CODE_PREDICTOR_DEFAULTS.top_p,
        do_sample=talker.do_sample,
        seed=talker.seed,
    )


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row settings of a batch, as tensors [B] on the logits' device (built once per batch change)."""

    temperature: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] float32, 1.0 = off
    repetition_penalty: torch.Tensor  # [B] float32
    do_sample: torch.Tensor  # [B] bool

    @classmethod
    def from_params(
        cls, params: Sequence[SamplingParams], device: torch.device | str | None = None
    ) -> SamplingBatch:
        def t(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            temperature=t([p.temperature for p in params], torch.float32),
            top_k=t([p.top_k for p in params], torch.int64),
            top_p=t([p.top_p for p in params], torch.float32),
            repetition_penalty=t([p.repetition_penalty for p in params], torch.float32),
            do_sample=t([p.do_sample for p in params], torch.bool),
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


def codec_suppress_ids(vocab_size: int, eos_id: int) -> list[int]:
    """The Talker's suppressed ids: every codec special (the top 1024 ids) except EOS, as the reference."""
    return [i for i in range(vocab_size - 1024, vocab_size) if i != eos_id]


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


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """argmax ids [B]."""
    return logits.argmax(dim=-1)


def sample(logits: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw ids [B] from softmax(logits).

    argmax(p / E) with E ~ Exp(1) is an exact categorical draw (the exponential-race trick): unlike
    torch.multinomial it needs no host sync and keeps one static shape.
    """
    probs = torch.softmax(logits.float(), dim=-1)  # [B, V]
    race = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return (probs / race).argmax(dim=-1)


# ---------------------------------------------------------------------------------------------------------
# One decoding step


def process_logits(
    logits: torch.Tensor,
    params: SamplingParams | SamplingBatch,
    seen: torch.Tensor | None = None,
    suppress_ids: torch.Tensor | Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores for greedy, scores for sampling), both [B, V] float32, in transformers' processor order."""
    scores = logits.float()
    penalty = params.repetition_penalty
    if seen is not None and (isinstance(penalty, torch.Tensor) or penalty != 1.0):
        scores = apply_repetition_penalty(scores, seen, penalty)
    if suppress_ids is not None:
        scores = suppress(scores, suppress_ids)
    temperature = params.temperature
    if isinstance(params, SamplingBatch):  # greedy rows may carry any temperature: keep them finite
        temperature = torch.where(params.do_sample, params.temperature, torch.ones_like(params.temperature))
    warped = top_p_filter(top_k_filter(apply_temperature(scores, temperature), params.top_k), params.top_p)
    return scores, warped


def sample_next(
    logits: torch.Tensor,
    params: SamplingParams | SamplingBatch,
    seen: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    suppress_ids: torch.Tensor | Sequence[int] | None = None,
) -> torch.Tensor:
    """The next ids [B] for logits [B, V] of the last position. Pure: update `seen` with `mark_seen`.

    Greedy (do_sample False) takes the argmax after repetition penalty and suppression; temperature,
    top-k and top-p only act when sampling, as in transformers.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got {tuple(logits.shape)}")
    if isinstance(params, SamplingParams):
        if not params.do_sample:
            scores = logits.float()
            if seen is not None and params.repetition_penalty != 1.0:
                scores = apply_repetition_penalty(scores, seen, params.repetition_penalty)
            if suppress_ids is not None:
                scores = suppress(scores, suppress_ids)
            return greedy(scores)
        _, warped = process_logits(logits, params, seen, suppress_ids)
        return sample(warped, generator)
    scores, warped = process_logits(logits, params, seen, suppress_ids)
    return torch.where(params.do_sample.to(logits.device), sample(warped, generator), greedy(scores))


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A seeded generator on `device`, or None (the global RNG) when no seed is given."""
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g
