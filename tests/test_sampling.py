"""Sampling against transformers' logits processors: the processors exactly, the device sampler's draws
by a chi-square test against the processed distribution; keyed draws are reproducible and batch-invariant."""

from __future__ import annotations

import pytest
import torch

from omni_rt.config import Sampling, StageSampling
from omni_rt.model import sampling as S

lp = pytest.importorskip("transformers.generation.logits_process")

V = 300


def rand_logits(b=4, v=V, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, v, generator=g) * scale


def rand_history(b=4, t=12, v=V, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, v, (b, t), generator=g)


@pytest.mark.parametrize("penalty", [1.05, 1.3, 0.8])
def test_repetition_penalty_matches_transformers(penalty):
    logits, ids = rand_logits(), rand_history()
    want = lp.RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone())
    got = S.apply_repetition_penalty(logits, S.history_from_ids(ids, V), penalty)
    assert torch.equal(got, want)
    assert not torch.equal(got, logits)
    # built step by step with mark_seen, the static mask is the same history
    seen = S.new_history(4, V)
    for t in range(ids.shape[1]):
        S.mark_seen(seen, ids[:, t])
    assert torch.equal(S.apply_repetition_penalty(logits, seen, penalty), want)
    # per-row penalties
    per_row = torch.tensor([penalty, 1.0, penalty, 2.0])
    got_rows = S.apply_repetition_penalty(logits, seen, per_row)
    assert torch.equal(got_rows[0], want[0]) and torch.equal(got_rows[1], logits[1])
    assert torch.equal(got_rows[3], lp.RepetitionPenaltyLogitsProcessor(2.0)(ids, logits.clone())[3])


def test_suppress_matches_transformers():
    logits = rand_logits()
    ids = S.codec_suppress_ids(V + 1024 - 200, V - 150)  # ids from V-200 up, bar one
    ids = [i for i in ids if i < V]
    want = lp.SuppressTokensLogitsProcessor(ids, device="cpu")(None, logits.clone())
    assert torch.equal(S.suppress(logits, ids), want)
    assert torch.equal(S.suppress(logits, S.suppress_mask(V, ids)), want)
    assert torch.isfinite(S.suppress(logits, ids)[:, V - 150]).all()  # EOS kept


def test_codec_suppress_ids_keep_eos():
    ids = S.codec_suppress_ids(3072, 2150)
    assert len(ids) == 1023 and min(ids) == 2048 and max(ids) == 3071 and 2150 not in ids
    assert sorted(S.codec_suppress_ids(3072, 2150, suppress_eos=True)) == list(range(2048, 3072))


@pytest.mark.parametrize("t", [0.5, 0.9, 1.7])
def test_temperature_matches_transformers(t):
    logits = rand_logits()
    assert torch.equal(S.apply_temperature(logits, t), lp.TemperatureLogitsWarper(t)(None, logits.clone()))


@pytest.mark.parametrize("k", [1, 5, 50, V + 10])
def test_top_k_matches_transformers(k):
    logits = rand_logits()
    logits[0, :10] = 1.0  # ties at the threshold are kept by both
    want = lp.TopKLogitsWarper(k)(None, logits.clone())
    assert torch.equal(S.top_k_filter(logits, k), want)
    assert torch.equal(S.top_k_filter(logits, torch.full((4,), k)), want)  # per-row form


def test_top_k_zero_is_off_and_per_row_mixes():
    logits = rand_logits()
    assert torch.equal(S.top_k_filter(logits, 0), logits)
    got = S.top_k_filter(logits, torch.tensor([0, 3, 0, 7]))
    assert torch.equal(got[0], logits[0]) and torch.equal(got[2], logits[2])
    assert torch.isfinite(got[1]).sum() == 3 and torch.isfinite(got[3]).sum() == 7


@pytest.mark.parametrize("p", [0.05, 0.5, 0.8, 0.95, 0.999])
def test_top_p_matches_transformers(p):
    logits = rand_logits(scale=2.0)
    want = lp.TopPLogitsWarper(p)(None, logits.clone())
    assert torch.equal(S.top_p_filter(logits, p), want)
    assert torch.equal(S.top_p_filter(logits, torch.full((4,), p)), want)


def test_top_p_edge_cases():
    logits = torch.tensor([[4.0, 1.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0]])
    # tiny p keeps exactly the top token (at least one always stays)
    kept = torch.isfinite(S.top_p_filter(logits, 1e-6))
    assert kept[0].tolist() == [True, False, False, False] and kept[1].sum() == 1
    # p = 1 keeps everything, even tokens whose probability underflows
    extreme = torch.tensor([[0.0, -200.0, -300.0, 50.0]])
    assert torch.equal(S.top_p_filter(extreme, 1.0), extreme)
    assert torch.equal(S.top_p_filter(extreme, torch.tensor([1.0])), extreme)
    # the kept set reaches p: probs [.5, .25, .25] with p = .5 keeps only the first
    half = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))
    assert torch.isfinite(S.top_p_filter(half, 0.5)).tolist() == [[True, False, False]]
    assert torch.isfinite(S.top_p_filter(half, 0.6)).sum() >= 2


def rows(s: StageSampling, b: int = 4) -> S.RowSettings:
    return S.RowSettings.of([s] * b)


def chain(s: StageSampling, suppressed: list[int] | None = None) -> lp.LogitsProcessorList:
    """transformers' processors for one stage's settings, in generate's order."""
    procs = [lp.RepetitionPenaltyLogitsProcessor(s.repetition_penalty)] if s.repetition_penalty != 1.0 else []
    if suppressed:
        procs.append(lp.SuppressTokensLogitsProcessor(suppressed, device="cpu"))
    procs.append(lp.TemperatureLogitsWarper(s.temperature))
    if s.top_k:
        procs.append(lp.TopKLogitsWarper(s.top_k))
    if s.top_p < 1.0:
        procs.append(lp.TopPLogitsWarper(s.top_p))
    return lp.LogitsProcessorList(procs)


def test_warpers_in_transformers_order():
    """The processed sampling scores equal transformers' processor chain for the Talker's defaults."""
    logits, ids = rand_logits(), rand_history()
    s = StageSampling(temperature=0.9, top_k=50, top_p=0.8, repetition_penalty=1.05)
    supp = list(range(V - 40, V))
    want = chain(s, supp)(ids, logits.clone())
    _, warped = S.process_logits(logits, rows(s), S.history_from_ids(ids, V), S.suppress_mask(V, supp))
    assert torch.equal(warped, want)


def test_greedy_applies_penalty_and_suppression_but_ignores_temperature():
    logits = torch.tensor([[5.0, 4.9, 1.0, 6.0]])
    seen = S.history_from_ids(torch.tensor([[0]]), 4)
    supp = S.suppress_mask(4, [3])
    for t in (0.1, 1.0, 7.0):
        s = StageSampling(temperature=t, top_k=1, repetition_penalty=1.05, do_sample=False)
        # id 3 suppressed; id 0 penalised (5 / 1.05 < 4.9) so id 1 wins
        got = S.choose(logits, rows(s, 1), torch.tensor([9]), 0, torch.tensor([0]), seen, supp)
        assert got.tolist() == [1]
    plain = S.choose(logits, rows(StageSampling(do_sample=False), 1), torch.tensor([9]), 0, torch.tensor([0]))
    assert plain.tolist() == [3]


def test_uniform_noise_is_uniform_and_keyed():
    seed, keys = torch.tensor([5, 5, 6]), torch.tensor([0, 1, 0])
    u = S.uniform_noise(seed, 1, keys, 50_000)  # [3, V]
    assert (u > 0).all() and (u < 1).all()
    torch.testing.assert_close(u.mean(dim=1), torch.full((3,), 0.5), rtol=0, atol=0.01)
    # rows differ by key, seed and stage; a row depends on nothing but its own (seed, stage, key)
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert not torch.equal(u[0], S.uniform_noise(seed[:1], 2, keys[:1], 50_000)[0])
    assert torch.equal(u[1], S.uniform_noise(seed[1:2], 1, keys[1:2], 50_000)[0])
    # neighbouring ids and keys are not correlated
    a = u[0] - 0.5
    assert abs(float((a[1:] * a[:-1]).mean() / (a * a).mean())) < 0.02
    b = u[1] - 0.5
    assert abs(float((a * b).mean() / (a * a).mean())) < 0.02
    # seeds beyond 32 bits still matter
    high = S.uniform_noise(torch.tensor([5 + (1 << 40)]), 1, keys[:1], 100)
    assert not torch.equal(high[0], u[0, :100])


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square test of counts against probabilities; bins expecting < 5 draws are pooled."""
    n = counts.sum()
    expected = probs.double() * n
    big = expected >= 5
    obs = torch.cat([counts[big].double(), counts[~big].double().sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    assert int((~keep & (obs > 0)).sum()) == 0, "draws landed where the distribution has no mass"
    stat = (((obs - exp) ** 2)[keep] / exp[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2))


DEFAULTS = Sampling()
CASES = {
    "thinker default": (DEFAULTS.thinker, None),
    "talker default": (DEFAULTS.talker, list(range(56, 64))),  # penalty 1.05, codec specials suppressed
    "code predictor default": (DEFAULTS.code_predictor, None),
    "hot, top-p only, strong penalty": (
        StageSampling(temperature=1.6, top_p=0.9, repetition_penalty=1.3),
        None,
    ),
    "cold, top-k 5": (StageSampling(temperature=0.7, top_k=5, repetition_penalty=0.9), [0, 1]),
}


@pytest.mark.parametrize("top_k_first", [True, False], ids=["top-k first", "whole vocabulary"])
@pytest.mark.parametrize("case", CASES)
def test_draws_follow_the_reference_distribution(case, top_k_first):
    """20,000 keyed draws for fixed logits match softmax(transformers' processed logits) (p > 0.001),
    by both paths (a case without top-k takes the whole vocabulary either way)."""
    s, supp = CASES[case]
    vocab, n = 64, 20_000
    logits = rand_logits(b=1, v=vocab, seed=3, scale=1.5)  # [1, V]: a spread-out distribution
    history = torch.tensor([[2, 7, 7, 30, 41]])
    want = torch.softmax(chain(s, supp)(history, logits.clone())[0], dim=-1)  # [V]
    seen = S.history_from_ids(history, vocab).expand(n, vocab)
    mask = None if supp is None else S.suppress_mask(vocab, supp)
    draws = S.choose(
        logits.expand(n, vocab), rows(s, n), torch.full((n,), 11), 0, torch.arange(n), seen, mask, top_k_first
    )  # [n]: one draw per step key
    counts = torch.bincount(draws, minlength=vocab)
    assert chi_square_p(counts, want) > 0.001
    # the test can fail: the same draws against the unprocessed distribution are rejected
    assert chi_square_p(counts, torch.softmax(logits[0], dim=-1)) < 1e-6


def random_rows(b: int, g: torch.Generator, top_p: bool) -> S.RowSettings:
    """Mixed per-row settings: mostly sampled, top-k 1..79 (some above a small vocabulary), some top-p."""
    return S.RowSettings.of(
        [
            StageSampling(
                do_sample=bool(torch.rand(1, generator=g) < 0.8),
                temperature=float(torch.rand(1, generator=g)) + 0.3,
                top_k=int(torch.randint(1, 80, (1,), generator=g)),
                top_p=float(torch.rand(1, generator=g)) * 0.5 + 0.5 if top_p else 1.0,
                repetition_penalty=1.1,
            )
            for _ in range(b)
        ]
    )


def test_top_k_first_draws_what_the_whole_vocabulary_draws():
    """The CPU's top-k-first path makes the very choices of the whole-vocabulary path (the GPU's): the
    same survivors, scores and keyed uniforms, over batches of mixed settings, penalties, suppression,
    k above the vocabulary, and ties at the k-th score (kept, so more than k survive)."""
    g = torch.Generator().manual_seed(0)
    rows_seen = 0
    for trial in range(200):
        b, vocab = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(5, 3000, (1,), generator=g))
        logits = torch.randn(b, vocab, generator=g) * (float(torch.rand(1, generator=g)) * 4 + 0.5)
        r = random_rows(b, g, top_p=trial % 2 == 1)
        if (
            trial % 4 == 0
        ):  # many equal scores around the k-th; top-p off (it drops equal scores by sort order)
            logits = (logits * 2).round() / 2
            r = r._replace(top_p=torch.ones(b))
        if trial % 3 == 2:  # no penalty: skipped on the top-k-first path
            r = r._replace(repetition_penalty=torch.ones(b))
        seen = torch.rand(b, vocab, generator=g) < 0.1
        supp = S.suppress_mask(vocab, list(range(0, vocab, 7)))
        seed, keys = torch.randint(0, 2**40, (b,), generator=g), torch.randint(0, 1000, (b,), generator=g)
        fast = S.choose_top_k_first(logits, r, seed, 1, keys, seen, supp)
        assert fast is not None
        assert torch.equal(fast, S.choose(logits, r, seed, 1, keys, seen, supp, top_k_first=False)), trial
        rows_seen += b
    assert rows_seen > 400


def test_top_k_first_needs_a_top_k_on_every_sampled_row():
    logits = rand_logits(b=3)
    seed, keys = torch.tensor([1, 2, 3]), torch.tensor([0, 0, 0])
    mixed = S.RowSettings.of([StageSampling(top_k=20), StageSampling(top_k=0), StageSampling(top_k=5)])
    assert S.choose_top_k_first(logits, mixed, seed, 0, keys) is None  # top-k off: the whole vocabulary
    # a greedy row without top-k does not need one: it takes the argmax
    greedy = S.RowSettings.of(
        [StageSampling(top_k=20), StageSampling(do_sample=False), StageSampling(top_k=5)]
    )
    got = S.choose_top_k_first(logits, greedy, seed, 0, keys)
    assert got is not None and int(got[1]) == int(logits[1].argmax())
    assert torch.equal(got, S.choose(logits, greedy, seed, 0, keys, top_k_first=False))
    # choose falls back by itself
    assert torch.equal(
        S.choose(logits, mixed, seed, 0, keys), S.choose(logits, mixed, seed, 0, keys, top_k_first=False)
    )


def test_the_hash_is_the_same_in_numpy_and_torch():
    """The CPU hashes in Python ints and numpy (`uniform_noise_at`), a device in torch: the same integer
    arithmetic, the same bits (int64 products past 2**63 wrap, Python's do not: only the low 32 bits are
    kept), so draws do not depend on where they are made."""
    seed = torch.tensor([5, 2**62 + 12345, 0])
    keys = torch.tensor([3, 2**40 + 7, 123456])
    ids = torch.randint(0, 152064, (3, 50), generator=torch.Generator().manual_seed(0))
    rows = S._row_hash(seed, 1, keys)
    assert rows.tolist() == [S._row_hash(a, 1, b) for a, b in zip(seed.tolist(), keys.tolist(), strict=True)]
    got = S._hash_bits(rows.numpy(), ids.numpy())
    assert torch.equal(torch.from_numpy(got), S._hash_bits(rows, ids))
    u = ((S._hash_bits(rows, ids) >> 9).float() + 0.5) * (1.0 / (1 << 23))  # torch end to end
    assert torch.equal(S.uniform_noise_at(seed, 1, keys, ids), u)


def test_noise_at_ids_is_the_vocabulary_noise_there():
    seed, keys = torch.tensor([5, 9]), torch.tensor([3, 4])
    whole = S.uniform_noise(seed, 2, keys, 1000)  # [2, V]
    ids = torch.tensor([[0, 17, 999], [5, 6, 500]])
    assert torch.equal(S.uniform_noise_at(seed, 2, keys, ids), whole.gather(1, ids))


def test_stage_sampler_is_keyed_batch_invariant_and_observes():
    vocab = 40
    sampler = S.StageSampler("talker", 5, vocab, suppress=[38, 39])
    hot = StageSampling(temperature=1.5, repetition_penalty=1.2)
    for slot, seed in ((0, 1), (1, 2), (2, 1), (3, 1)):
        sampler.assign(slot, hot, seed, history_ids=torch.tensor([3, 4]))
    sampler.assign(4, hot.model_copy(update={"do_sample": False}), 1, suppress_extra=[0])
    logits = rand_logits(b=5, v=vocab, seed=4)
    logits[:, 0] = 50.0  # id 0 would always win: suppressed for slot 4 only
    keys = torch.tensor([7, 7, 7, 8, 7])
    # history resets on assign; seen rows restored between calls so each call starts the same
    seen = sampler.seen.clone()
    together = sampler(logits, torch.arange(5), keys)
    assert sampler.seen[torch.arange(5), together].all()  # the chosen ids are observed
    sampler.seen.copy_(seen)
    alone = [int(sampler(logits[i : i + 1], torch.tensor([i]), keys[i : i + 1])) for i in range(5)]
    sampler.seen.copy_(seen)
    assert together.tolist() == alone  # a row's draw depends on its own slot and key only
    assert alone[0] == alone[2] and together[4] not in (0, 38, 39)  # same seed, key and logits; suppressed
    flat = torch.zeros(1, vocab)  # uniform logits: draws by key and seed spread over the vocabulary
    by_key = {int(sampler(flat, torch.tensor([0]), torch.tensor([k]))) for k in range(40)}
    assert len(by_key) > 10 and not by_key & {38, 39}
    sampler.assign(0, hot, 1)
    assert not sampler.seen[0].any()


def test_frame_sampler_keys_each_code_group():
    sampler = S.StageSampler("code_predictor", 2, 30, history=False)
    sampler.assign(0, StageSampling(temperature=2.0), 3)
    flat, slot = torch.zeros(1, 30), torch.tensor([0])
    draw = S.frame_sampler(sampler, slot, torch.tensor([5]))
    codes = [int(draw(flat)) for _ in range(15)]
    assert len(set(codes)) > 5  # each call is its own key: group i of Talker position 5
    again = S.frame_sampler(sampler, slot, torch.tensor([5]))
    assert [int(again(flat)) for _ in range(15)] == codes
    other = S.frame_sampler(sampler, slot, torch.tensor([6]))
    assert [int(other(flat)) for _ in range(15)] != codes


def test_a_frame_on_the_cpu_draws_what_the_stage_sampler_draws():
    """`frame_sampler` on the CPU reads the rows' settings once a frame (`TopKFirst`) instead of once a
    draw: the same 15 choices as calling the sampler per code group, over mixed rows (greedy ones,
    temperatures, k above the vocabulary, top-p on and off, ties at the k-th score)."""
    g = torch.Generator().manual_seed(1)
    vocab, b = 300, 4
    for trial in range(40):
        sampler = S.StageSampler("code_predictor", b + 1, vocab, history=False)
        for slot in range(b):
            p = float(torch.rand(1, generator=g)) * 0.5 + 0.5 if trial % 2 else 1.0
            s = StageSampling(
                do_sample=bool(torch.rand(1, generator=g) < 0.8) or trial % 5 == 0,
                temperature=1.0 if trial % 3 == 0 else float(torch.rand(1, generator=g)) + 0.3,
                top_k=50 if trial % 4 == 0 else int(torch.randint(1, 400, (1,), generator=g)),
                top_p=p,
            )
            sampler.assign(slot, s, int(torch.randint(0, 2**40, (1,), generator=g)))
        slots, keys = torch.tensor([3, 0, 2, 1]), torch.randint(0, 1000, (b,), generator=g)
        logits = torch.randn(15, b, vocab, generator=g)
        if trial % 4 == 1:
            logits = (logits * 2).round() / 2  # ties
        draw = S.frame_sampler(sampler, slots, keys)
        got = [draw(logits[i]) for i in range(15)]
        want = [sampler(logits[i], slots, keys * S.CODE_KEY_STRIDE, key_offset=i) for i in range(15)]
        assert torch.equal(torch.stack(got), torch.stack(want)), trial


def test_seeds_are_validated_and_fresh_when_missing():
    assert Sampling(seed=4).response_seed() == 4
    assert len({Sampling().response_seed() for _ in range(5)}) == 5
    for bad in (-1, 2**63):
        with pytest.raises(ValueError):
            Sampling(seed=bad)


def test_assigning_a_slot_writes_by_fills_never_by_host_scalar_copies():
    """`StageSampler.assign` runs on a stage's thread right after it has launched work (the Talker: a
    prompt prefix). On a GPU, `row[slot] = 0.9` and `row[slot, ids] = True` copy a host scalar, and
    such a copy is a blocking one that waits for the stage's whole stream. So assign must write by
    fills only: no copy from a 0-dim (host scalar) tensor, no index_put_ (which copies its scalar)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[tuple[str, list]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls.append((str(func), list(args)))
            return func(*args, **(kwargs or {}))

    sampler = S.StageSampler("talker", 4, 64, suppress=[60, 61])
    plain = S.StageSampler("talker", 4, 64, suppress=[60, 61])
    settings = StageSampling(temperature=0.7, top_k=9, top_p=0.8, repetition_penalty=1.3)
    history, extra = torch.tensor([3, 5]), [62]
    with Ops() as ops:
        sampler.assign(1, settings, 7, history_ids=history, suppress_extra=extra)
    scalar_copies = [
        name for name, args in ops.calls
        if (name.startswith("aten.copy_") and args[1].dim() == 0) or name.startswith("aten.index_put")
    ]  # fmt: skip
    assert not scalar_copies and any(name.startswith("aten.fill_") for name, _ in ops.calls)
    # what it wrote: the settings, the seed, the history and the suppression (compared with plain writes)
    plain.temperature[1], plain.top_k[1], plain.top_p[1] = 0.7, 9, 0.8
    plain.repetition_penalty[1], plain.do_sample[1], plain.seed[1] = 1.3, True, 7
    plain.seen[1, history] = True
    plain.suppress[1, extra] = True
    for name in (
        "temperature",
        "top_k",
        "top_p",
        "repetition_penalty",
        "do_sample",
        "seed",
        "seen",
        "suppress",
    ):
        assert torch.equal(getattr(sampler, name), getattr(plain, name)), name
