"""One-launch sampling for small vocabularies (the Talker's code 0, the code predictor's 15 codes).

Why: `omni_rt.model.sampling.StageSampler` in plain PyTorch is ~100 small launches per call (gathers of
the per-slot settings, two sorts, the counter hash as some 40 integer ops). A code-predictor frame calls
it 15 times, which in a CUDA graph costs more than the frame's own layers. One program per row here holds
the whole row (V <= 4096) in registers and does all of it: repetition penalty, suppression, greedy
argmax, temperature, top-k, top-p, the keyed exponential race, the choice by `do_sample`, and the
history update.

Numbers, against `sampling.choose` (the reference, called by the plain path):
- the same counter hash, in the same int64 arithmetic, so the same uniforms for each (seed, stage, key,
  vocab id); penalty and temperature by IEEE division (`tl.div_rn`, as PyTorch's kernels);
- greedy: the first index of the maximum, as torch.argmax: bit-equal ids;
- sampling: top-k keeps scores >= the k-th largest (ties kept), as transformers; top-p keeps scores >=
  the smallest one it keeps, so equal scores straddling the boundary are all kept, where transformers
  drops some of them by sort order; softmax, cumsum and logs may differ from PyTorch's by an fp32 ulp.
  Either can move a draw only when two candidates are within an ulp: the distribution is the same.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from omni_rt.kernels._common import next_pow2, precise, require_triton

MAX_VOCAB = 4096  # one row in one program's registers
# bf16 logits without a penalty: thresholds searched over 16-bit keys (16 halvings, not 32) where exact
SHORT_KEYS = True
# The per-id hash in uint32 arithmetic (wrapping multiplies, logical shifts) instead of int64 masked to 32
# bits: the same bits, fewer instructions (an int64 multiply is several). Off: no faster on an H200 (the
# sampled frame 1.820 ms against 1.823; 1.797 against 1.796 in 8 warps); the interpreter tests check the
# bits either way.
HASH32 = False
# Warps of the one program per row; None: 4 up to 2048 ids, 8 above. Each threshold halving is one
# reduction over the row plus a pass over each thread's share of it: 8 warps took the sampled frame
# (programmatic launches on) from 1.823 to 1.796 ms on an H200, 2.135 -> 2.116 on an H100; 1 and 2 warps
# were far slower (3.0, 2.2 ms), 16 no better (1.805). scripts/gpu_code_frame.py, docs/performance.md.
# With fewer reductions (3d15258) 4 warps are still slower: 6.36 us a code-predictor draw against 5.89 (H100).
SAMPLE_WARPS: int | None = 8
# Within `programmatic()` (the code-predictor frame's programmatic graphs) a programmatic dependent launch:
# it draws the race's noise before it waits for the logits, and lets the next step's first kernel start.
# The sampled frame with the Thinker idle took 1.760 ms with it, 1.779 without (greedy 1.680 either way),
# H200; so the gain is the noise drawn early. (Once, with the noise after the wait: 2.05 ms against 2.01.)
PROGRAMMATIC = True
# Top-k on 16-bit keys: the k-th largest by a histogram of the keys' distances below the largest, in this
# many bins (the last for every key further down), where it lies that near; else by bisection. A histogram
# and a scan against a count and 6 halvings: 5.74 / 5.60 -> 5.47 / 5.43 us a code-predictor draw (logits
# x1 / x3), Talker 8.71 -> 8.61 / 8.54, the same ids (H100, scripts/gpu_sampler_ab.py).
TOP_K_BINS = 128
_launching = threading.local()  # .pdl: inside `programmatic()` on this thread

try:  # the kernel needs Triton; the plain path does not
    import triton
    import triton.language as tl
    from omni_rt.kernels._triton import exp_f32, gdc_launch_dependents, gdc_wait, log_f32
except ImportError:  # pragma: no cover - depends on the machine
    triton = None

if triton is not None:
    _TOP_K_BINS = tl.constexpr(TOP_K_BINS)

    @triton.jit
    def _c(value: tl.constexpr):
        # an int64 constant: a bare literal above 2**31 would be typed uint32, and mixing it with int64
        # promotes differently compiled and interpreted
        return tl.full((), value, tl.int64)

    @triton.jit
    def _mix32(h):
        # murmur3's finaliser on uint32 values held in int64, as sampling._mix32
        m32 = _c(0xFFFFFFFF)
        h = h ^ (h >> 16)
        h = (h * _c(0x85EBCA6B)) & m32
        h = h ^ (h >> 13)
        h = (h * _c(0xC2B2AE35)) & m32
        return h ^ (h >> 16)

    @triton.jit
    def _mix32_u32(h):
        # _mix32 in uint32: a wrapping multiply keeps the low 32 bits that the int64 one masks to
        h = h ^ (h >> 16)
        h = h * tl.full((), 0x85EBCA6B, tl.uint32)
        h = h ^ (h >> 13)
        h = h * tl.full((), 0xC2B2AE35, tl.uint32)
        return h ^ (h >> 16)

    @triton.jit
    def _order_key(x):
        """fp32 -> int32 key with the same order (negative floats' magnitude bits flipped)."""
        b = x.to(tl.int32, bitcast=True)
        return b ^ ((b >> 31) & 0x7FFFFFFF)

    @triton.jit
    def _order_key16(x):
        """A bf16-exact fp32 -> its 16 bits as an int32 key in [-2**15, 2**15) with the same order."""
        h = x.to(tl.int32, bitcast=True) >> 16
        return h ^ ((h >> 15) & 0x7FFF)

    @triton.jit
    def _key_value(key, short):
        """The fp32 whose key (_order_key16 if short, else _order_key) this is: the same flip undoes it."""
        b = key.to(tl.int32)
        b16 = b ^ ((b >> 15) & 0x7FFF)
        b32 = b ^ ((b >> 31) & 0x7FFFFFFF)
        return tl.where(short, b16 << 16, b32).to(tl.float32, bitcast=True)

    @triton.jit
    def _key32(t):
        # an int64 threshold as an int32 key to compare with: below int32's range it counts every key
        return tl.maximum(t, -(2**31)).to(tl.int32)

    @triton.jit
    def _counts(key, a, b):
        """count(key >= a) and count(key >= b) in one reduction (top-k's binade check and the search's
        first halving): packed in one int32 sum, each count <= MAX_VOCAB < 2**16, so the low half never
        carries into the high. a, b int64."""
        both = tl.sum((key >= _key32(a)).to(tl.int32) + ((key >= _key32(b)).to(tl.int32) << 16), axis=0)
        return both & 0xFFFF, both >> 16

    @triton.jit
    def _mid(lo, hi):
        # where a halving of [lo, hi] counts (lo < hi)
        return (lo + hi + 1) >> 1

    @triton.jit
    def _halve(lo, hi, enough):
        # [lo, hi] after a count at `_mid`: its upper half if enough keys lie at or above the middle
        mid = _mid(lo, hi)
        return tl.where(enough, mid, lo), tl.where(enough, hi, mid - 1)

    @triton.jit
    def _kth_largest_key(key, k, lo, hi):
        """The largest t in [lo, hi] with count(key >= t) >= k (k >= 1, count(key >= lo) >= k): the k-th
        largest key, by bisection. `key` int32, lo and hi int64 (lo may lie below int32's range: a count
        there counts every key). The caller narrows the range first: each halving is one reduction.
        Not wider rounds, which were no faster on an H100 (docs/performance.md, 2026-12-06): 3, 7 or 15
        thresholds counted in a wider reduction were slower (code predictor 8.66 / 9.06 / 9.34 us a draw
        against 7.94, Talker 11.5-12.8 against 9.1); two thresholds in one packed sum (`_counts`, a third
        of the range a round) no faster (5.89 / 5.72 us against 5.72 / 5.73; Talker 8.80 against 8.74).
        """
        while lo < hi:
            enough = tl.sum((key >= _key32(_mid(lo, hi))).to(tl.int32), axis=0) >= k
            lo, hi = _halve(lo, hi, enough)
        return lo

    @triton.jit
    def _kth_near_top(key, k, top, BINS: tl.constexpr):
        """(whether the k-th largest key lies within BINS - 2 keys below `top`, the largest; if so, it),
        for 16-bit keys: by a histogram of each key's distance below the top (the last bin holds every
        key further down) and a scan of it, where a bisection counts once a halving. `top` int64."""
        edge = _key32(top - (BINS - 1))
        distance = tl.where(key > edge, top.to(tl.int32) - key, BINS - 1)
        at_most = tl.cumsum(tl.histogram(distance, BINS), 0)  # [i]: count(key >= top - i), i < BINS - 1
        before = tl.sum((at_most < k).to(tl.int32), axis=0)  # bins before the first to reach k
        return before < BINS - 1, top - before

    @triton.jit
    def _first_best(s1, i1, k1, s2, i2, k2):
        # the larger score, the first index among equal ones (as tl.argmax(tie_break_left=True)), its key
        first = (s1 > s2) | ((s1 == s2) & (i1 < i2))
        return tl.where(first, s1, s2), tl.where(first, i1, i2), tl.where(first, k1, k2)

    @triton.jit
    def _first_best_and_sum(s1, i1, k1, e1, s2, i2, k2, e2):
        s, i, k = _first_best(s1, i1, k1, s2, i2, k2)
        return s, i, k, e1 + e2

    @triton.jit
    def _mass_at(key, ex, won, total):
        # the softmax's mass at or below key `won`: summed, then divided once
        return tl.div_rn(tl.sum(tl.where(key <= won, ex, 0.0), axis=0), total)

    @triton.jit
    def _top_p_race(score, key, ex, limit, top, ids):
        """The race's winner among the scores top-p keeps, without searching for top-p's threshold.

        Top-p keeps the keys t whose mass at or below them, sum(ex[key <= t]) / sum(ex), exceeds `limit`
        (= 1 - p), and the largest key `top` always. The race's winner among a set that holds every kept
        key is the winner among the kept ones if it is kept itself; if not, no key at or below its own is
        kept, so the race runs again above it. The first winner is kept with probability >= p: ~1.25
        rounds where a search took ~8 reductions (bisection over the keys' range), and the first round's
        reduction also sums the softmax's denominator. The mass is summed before it is divided (one
        division, not one an id: PyTorch's softmax and cumsum round differently from either)."""
        _, choice, won, total = tl.reduce((score, ids, key, ex), 0, _first_best_and_sum)
        go = won < top  # the top is always kept: no mass to sum
        if go:
            go = _mass_at(key, ex, won, total) <= limit  # turned away
        while go:
            floor = won  # race the keys above it
            _, choice, won = tl.reduce(
                (tl.where(key > floor, score, float("-inf")), ids, key), 0, _first_best
            )
            # the last test: no endless loop
            go = (won < top) & (_mass_at(key, ex, won, total) <= limit) & (won > floor)
        return choice

    @triton.jit
    def _sample(
        logits_ptr,  # [B, V] any float dtype
        slots_ptr,  # [B] int64
        keys_ptr,  # [B] int64; each row's key is keys[row] + key_off
        temp_ptr,  # [S] float32
        topk_ptr,  # [S] int64
        topp_ptr,  # [S] float32
        pen_ptr,  # [S] float32
        dos_ptr,  # [S] bool
        seed_ptr,  # [S] int64
        seen_ptr,  # [S, V] bool, read and updated (HAS_SEEN)
        supp_ptr,  # [S, V] bool (HAS_SUPP)
        out_ptr,  # [B] int64
        V,
        stride_l,
        key_off,
        STAGE: tl.constexpr,
        HAS_SEEN: tl.constexpr,
        HAS_SUPP: tl.constexpr,
        BLOCK_V: tl.constexpr,
        PRECISE: tl.constexpr,
        KEY16: tl.constexpr,  # bf16 logits, no penalty: search 16-bit keys where exact (SHORT_KEYS)
        U32: tl.constexpr,  # the per-id hash in uint32 (HASH32)
        PDL: tl.constexpr,  # launched as a programmatic dependent launch (`programmatic`)
    ):
        if PDL:  # the next kernel's programs may start and fetch their weights
            gdc_launch_dependents()
        row = tl.program_id(0).to(tl.int64)
        # the rows' settings and keys are no earlier kernel's of this step: read before the wait below
        slot = tl.load(slots_ptr + row)
        step_key = tl.load(keys_ptr + row) + key_off
        v = tl.arange(0, BLOCK_V)
        vm = v < V
        sampled = tl.load(dos_ptr + slot) != 0
        # the race's noise -log E = -log(-log U), U from (seed, stage, key, vocab id): no logits needed, so
        # a programmatic launch draws it while the kernel before still runs
        noise = tl.zeros([BLOCK_V], tl.float32)
        if sampled:
            seed = tl.load(seed_ptr + slot)
            m32 = _c(0xFFFFFFFF)
            h = _mix32((seed & m32) ^ _c(0x9E3779B9))
            h = _mix32(h ^ ((seed >> 32) & m32))
            h = _mix32(h ^ ((_c(0x632BE5AB) * (STAGE + 1)) & m32))
            h = _mix32(h ^ (step_key & m32))
            h = _mix32(h ^ ((step_key >> 32) & m32))
            if U32:
                hu = h.to(tl.uint32)
                u = _mix32_u32(hu ^ (v.to(tl.uint32) * tl.full((), 0x9E3779B9, tl.uint32)))
                u = _mix32_u32(u ^ tl.full((), 0x85EBCA77, tl.uint32))
            else:
                u = _mix32(h ^ ((v.to(tl.int64) * _c(0x9E3779B9)) & m32))
                u = _mix32(u ^ _c(0x85EBCA77))
            uf = ((u >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
            noise = -log_f32(-log_f32(uf, PRECISE), PRECISE)  # w + noise is w - log E, bit for bit
        if PDL:  # the logits (and a history) are earlier kernels' writes
            gdc_wait()
        x = tl.load(logits_ptr + row * stride_l + v, mask=vm, other=float("-inf")).to(tl.float32)
        if HAS_SEEN:
            seen = tl.load(seen_ptr + slot * V + v, mask=vm, other=0) != 0
            pen = tl.load(pen_ptr + slot)
            x = tl.where(seen, tl.where(x < 0, x * pen, tl.div_rn(x, pen)), x)
        if HAS_SUPP:
            supp = tl.load(supp_ptr + slot * V + v, mask=vm, other=0) != 0
            x = tl.where(supp, float("-inf"), x)
        # A greedy row takes the argmax and nothing else; a sampled row none of it (a reduction saved)
        if sampled:
            t = tl.load(temp_ptr + slot)
            w = x
            if t != 1.0:  # an IEEE division an id, for nothing at the code predictor's default
                w = tl.div_rn(x, t)
            # Thresholds by bisection over the scores' order-preserving integer keys, not by sorting: two
            # bitonic sorts of a 2048-wide row were ~70 us per call on an H200, 1.1 ms of a sampled
            # code-predictor frame (docs/performance.md). Each halving is one reduction over the row, so
            # fewer key bits mean a faster search: bf16 logits with no penalty have 16 bits, and w = x / t
            # orders as x does (t > 0) unless the division overflows or leaves fp32's normal range.
            if KEY16:
                short = t == 1.0  # w is x (the code predictor's default): no check, two reductions saved
                if t != 1.0:
                    aw = tl.where(x == 0.0, 1.0, tl.abs(w))
                    short = (tl.max(tl.where(aw == float("inf"), 0.0, aw), axis=0) < 1e38) & (
                        tl.min(aw, axis=0) > 1e-36
                    )
            else:
                short = False
            # top-k: scores below the k-th largest go (k = 0: off; k >= V keeps all). With 16-bit keys a
            # histogram of the distances below the row's largest key finds the k-th where it lies within
            # TOP_K_BINS - 2 keys of it (top-50 of 2048 near-normal scores does: `_kth_near_top`).
            # Otherwise a bisection runs below the largest key, not over the whole key space: one count
            # asks whether the k-th lies within a binade of it (128 16-bit keys, 2**23 32-bit ones): then
            # 7 bits to search, not ~15; only if not, down to the row's smallest key. The same reduction
            # counts at the binade's middle, so the search starts on half of it. Every reduction saved
            # counts: the code predictor draws 15 times a frame.
            k = tl.load(topk_ptr + slot)
            cut = (k > 0) & (k < V)
            # int32 keys (cheaper compares than int64), for top-p too: those of scores top-k drops do not
            # count there (their scores are -inf, their exponentials 0)
            key = tl.where(short, _order_key16(x), _order_key(w))
            top = tl.full((), 0, tl.int64)  # the largest key (top-p keeps it always)
            if cut:
                top = tl.max(key, axis=0).to(tl.int64)
                near = top < top  # False, as a scalar the branches below can set
                kth = top
                if short:
                    near, kth = _kth_near_top(key, k, top, _TOP_K_BINS)
                if not near:
                    lo = top - tl.where(short, 128, 2**23).to(tl.int64)  # a binade below the top
                    hi = top
                    # counted with the check: the search's first halving
                    at_lo, at_mid = _counts(key, lo, _mid(lo, top))
                    if at_lo < k:
                        lo = tl.min(key, axis=0).to(tl.int64)  # the k-th lies further down
                    else:
                        lo, hi = _halve(lo, top, at_mid >= k)
                    kth = _kth_largest_key(key, k, lo, hi)
                w = tl.where(key < kth, float("-inf"), w)
            # the keyed race: argmax(w - log E)
            score = tl.where(vm, w + noise, float("-inf"))
            # top-p, transformers' rule on the ascending order (drop while the cumulative mass <= 1 - p):
            # keep the scores whose mass at or below them exceeds 1 - p, ties together; the top always stays.
            p = tl.load(topp_ptr + slot)
            if p < 1.0:
                if not cut:  # after top-k its largest key is known
                    top = tl.max(key, axis=0).to(tl.int64)
                # the largest w, from its key (x / t rounds monotonically): no reduction for it
                wtop = _key_value(top, short)
                wtop = tl.where(short, tl.div_rn(wtop, t), wtop)
                ex = exp_f32(w - wtop, PRECISE)
                choice = _top_p_race(score, key, ex, 1 - p, top, v).to(tl.int64)
            else:
                choice = tl.argmax(score, axis=0, tie_break_left=True).to(tl.int64)
        else:
            choice = tl.argmax(x, axis=0, tie_break_left=True).to(tl.int64)
        tl.store(out_ptr + row, choice)
        if HAS_SEEN:
            tl.store(seen_ptr + slot * V + choice, 1)


@contextlib.contextmanager
def programmatic(on: bool = True):
    """Within, on this thread: each draw is a programmatic dependent launch of the kernel before it.

    For the code-predictor frame's programmatic graphs, where the kernel before is the head's GEMV (it
    calls `gdc_launch_dependents`). Before its wait the sampler reads only the rows' slots, settings and
    keys, which no kernel of the frame's steps writes."""
    saved = getattr(_launching, "pdl", False)
    _launching.pdl = on and PROGRAMMATIC
    try:
        yield
    finally:
        _launching.pdl = saved


def fits(vocab: int) -> bool:
    """Can one program hold a row of this vocabulary?"""
    return vocab <= MAX_VOCAB


def fused_choose(
    logits: torch.Tensor,  # [B, V]
    slots: torch.Tensor,  # [B] int64
    keys: torch.Tensor,  # [B] int64
    sampler,  # omni_rt.model.sampling.StageSampler: its per-slot tables
    key_offset: int = 0,  # added to every key (a frame's code group), so no launch adds it
) -> torch.Tensor:
    """`StageSampler.__call__` in one launch: ids [B], observed in the slots' histories."""
    require_triton()
    b, vocab = logits.shape
    if not fits(vocab):
        raise ValueError(f"fused sampling holds a row of at most {MAX_VOCAB} ids, got {vocab}")
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    if b == 0:
        return out
    seen, supp = sampler.seen, sampler.suppress
    block = next_pow2(vocab)
    pdl = getattr(_launching, "pdl", False)
    _sample[(b,)](
        logits, slots, keys,
        sampler.temperature, sampler.top_k, sampler.top_p, sampler.repetition_penalty,
        sampler.do_sample, sampler.seed,
        seen if seen is not None else out, supp if supp is not None else out, out,
        vocab, logits.stride(0), key_offset,
        STAGE=sampler.stage, HAS_SEEN=seen is not None, HAS_SUPP=supp is not None,
        BLOCK_V=block, PRECISE=precise(),
        KEY16=SHORT_KEYS and logits.dtype == torch.bfloat16 and seen is None, U32=HASH32, PDL=pdl,
        num_warps=SAMPLE_WARPS or (4 if block <= 2048 else 8), **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip
    return out
