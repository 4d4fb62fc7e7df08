"""Sampling functions against transformers' logits processors, and seeded sampling behaviour."""

from __future__ import annotations

import pytest
import torch

from omni_rt.errors import ConfigError
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
    ids = S.codec_suppress_ids(V + 1024 - 200, eos_id=V - 150)  # ids from V-200 up, bar one
    ids = [i for i in ids if i < V]
    want = lp.SuppressTokensLogitsProcessor(ids, device="cpu")(None, logits.clone())
    assert torch.equal(S.suppress(logits, ids), want)
    assert torch.equal(S.suppress(logits, S.suppress_mask(V, ids)), want)
    assert torch.isfinite(S.suppress(logits, ids)[:, V - 150]).all()  # EOS kept


def test_codec_suppress_ids_keep_eos():
    ids = S.codec_suppress_ids(3072, eos_id=2150)
    assert len(ids) == 1023 and min(ids) == 2048 and max(ids) == 3071 and 2150 not in ids


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


def test_warpers_in_transformers_order():
    """The processed sampling scores equal transformers' processor chain for the Talker's defaults."""
    logits, ids = rand_logits(), rand_history()
    params = S.SamplingParams(temperature=0.9, top_k=50, top_p=0.8, repetition_penalty=1.05, do_sample=True)
    supp = list(range(V - 40, V))
    chain = lp.LogitsProcessorList(
        [
            lp.RepetitionPenaltyLogitsProcessor(1.05),
            lp.SuppressTokensLogitsProcessor(supp, device="cpu"),
            lp.TemperatureLogitsWarper(0.9),
            lp.TopKLogitsWarper(50),
            lp.TopPLogitsWarper(0.8),
        ]
    )
    want = chain(ids, logits.clone())
    greedy_scores, warped = S.process_logits(
        logits, params, S.history_from_ids(ids, V), S.suppress_mask(V, supp)
    )
    assert torch.equal(warped, want)
    batch = S.SamplingBatch.from_params([params] * 4)
    _, warped_b = S.process_logits(logits, batch, S.history_from_ids(ids, V), S.suppress_mask(V, supp))
    assert torch.equal(warped_b, want)


def test_greedy_applies_penalty_and_suppression_but_ignores_temperature():
    logits = torch.tensor([[5.0, 4.9, 1.0, 6.0]])
    seen = S.history_from_ids(torch.tensor([[0]]), 4)
    for t in (0.1, 1.0, 7.0):
        params = S.SamplingParams(temperature=t, top_k=1, repetition_penalty=1.05, do_sample=False)
        # id 3 suppressed; id 0 penalised (5 / 1.05 < 4.9) so id 1 wins
        assert S.sample_next(logits, params, seen, suppress_ids=[3]).tolist() == [1]
    assert S.sample_next(logits, S.SamplingParams()).tolist() == [3]


def test_seeded_sampling_repeats_and_respects_filters():
    logits = rand_logits(b=8)
    params = S.SamplingParams(temperature=1.5, top_k=20, do_sample=True, seed=123)
    a = [S.sample_next(logits, params, generator=S.make_generator(params.seed)) for _ in range(2)]
    assert torch.equal(a[0], a[1])
    g = S.make_generator(params.seed)
    draws = torch.stack([S.sample_next(logits, params, generator=g) for _ in range(30)])  # [30, B]
    assert len(set(draws[:, 0].tolist())) > 1  # it really samples
    allowed = torch.topk(logits, 20).indices  # [B, 20]
    for row in range(8):
        assert set(draws[:, row].tolist()) <= set(allowed[row].tolist())
    assert S.make_generator(None) is None


def test_sample_draws_from_the_softmax():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    logits = probs.log().expand(40000, -1).contiguous()
    ids = S.sample(logits, torch.Generator().manual_seed(0))
    freq = torch.bincount(ids, minlength=5).float() / ids.numel()
    torch.testing.assert_close(freq, probs, rtol=0, atol=0.01)


def test_batch_mixes_greedy_and_sampling_rows():
    logits = rand_logits(b=3)
    batch = S.SamplingBatch.from_params(
        [S.SamplingParams(), S.SamplingParams(temperature=2.0, do_sample=True), S.SamplingParams(top_k=1)]
    )
    g = torch.Generator().manual_seed(1)
    draws = torch.stack([S.sample_next(logits, batch, generator=g) for _ in range(20)])  # [20, 3]
    assert (draws[:, 0] == logits[0].argmax()).all() and (draws[:, 2] == logits[2].argmax()).all()
    assert len(set(draws[:, 1].tolist())) > 1


def test_defaults_follow_the_reference():
    t = S.TALKER_DEFAULTS
    assert (t.temperature, t.top_k, t.top_p, t.repetition_penalty, t.do_sample) == (0.9, 50, 1.0, 1.05, True)
    cp = S.code_predictor_params(t)
    assert (cp.top_k, cp.top_p, cp.do_sample, cp.repetition_penalty) == (50, 0.8, True, 1.0)
    assert S.code_predictor_params(S.SamplingParams(do_sample=False)).do_sample is False
    assert S.THINKER_DEFAULTS.do_sample is False


@pytest.mark.parametrize(
    "bad",
    [dict(temperature=0.0), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5), dict(repetition_penalty=0.0)],
)
def test_bad_params_raise_config_error(bad):
    with pytest.raises(ConfigError):
        S.SamplingParams(**bad)
