"""The one-launch sampler (kernels/sample.py) against `sampling.StageSampler`'s plain path.

Run in Triton's interpreter on the CPU. Both hash the same counters in the same integer arithmetic, so
they make the same draws: greedy ids bit-equal, sampled ids equal unless two candidates lie within an
fp32 ulp (not the case for these seeded logits), the histories updated alike.
"""

import pytest
import torch
from triton_env import needs_triton

from omni_rt.config import Sampling, StageSampling
from omni_rt.model import sampling as S

pytestmark = needs_triton

SETTINGS = [
    Sampling().talker,  # temperature 0.9, top-k 50, penalty 1.05
    Sampling().code_predictor,  # top-k 50, top-p 0.8
    StageSampling(temperature=1.4, top_p=0.7, repetition_penalty=1.3),
    StageSampling(temperature=0.5, top_k=3),
    StageSampling(temperature=0.7, top_k=20, top_p=0.9),  # both filters at another temperature
    StageSampling(top_k=5000),  # above the vocabulary: no filter
    StageSampling(do_sample=False, repetition_penalty=1.2),  # greedy after penalty and suppression
]


def pair(vocab: int, suppress, history: bool):
    slots = len(SETTINGS) + 1
    plain = S.StageSampler("talker", slots, vocab, suppress=suppress, history=history)
    fused = S.StageSampler("talker", slots, vocab, suppress=suppress, history=history, fused=True)
    g = torch.Generator().manual_seed(0)
    for slot, s in enumerate(SETTINGS):
        past = torch.randint(0, vocab, (12,), generator=g)
        extra = [1] if slot % 2 else []
        for sampler in (plain, fused):
            sampler.assign(
                slot, s, seed=1000 + slot, history_ids=past if history else None, suppress_extra=extra
            )
    return plain, fused


# small vocabularies: Triton's interpreter sorts a 2048-wide row in minutes (the kernel takes up to 4096)
@pytest.mark.parametrize("hash32", [False, True])  # the per-id hash in int64 or uint32: the same bits
@pytest.mark.parametrize("vocab, suppress, history", [(200, [190, 191, 199], True), (100, None, False)])
def test_fused_sampler_makes_the_plain_draws(vocab, suppress, history, hash32, monkeypatch):
    from omni_rt.kernels import sample as sample_kernel

    monkeypatch.setattr(sample_kernel, "HASH32", hash32)
    plain, fused = pair(vocab, suppress, history)
    assert fused._fused is not None and plain._fused is None
    n = len(SETTINGS)
    slots = torch.arange(n)
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        logits = torch.randn(n, vocab, generator=g) * 3  # as a bf16 lm_head gives (below)
        if step == 2:  # a few far above the rest: the k-th largest is binades below the top
            logits[:, :8] = 40.0 + 4.0 * torch.arange(8)
        if step == 3:  # all negative
            logits = -logits.abs() - 2.0
        logits = logits.to(torch.bfloat16)
        keys = torch.full((n,), 40 + step) + slots
        want, got = plain(logits, slots, keys), fused(logits, slots, keys)
        assert got.tolist() == want.tolist()
        if history:
            assert torch.equal(fused.seen, plain.seen)  # the choices were observed alike


def test_fused_frame_draws_vary_by_group():
    sampler = S.StageSampler("code_predictor", 2, 64, history=False, fused=True)
    sampler.assign(0, StageSampling(temperature=3.0), 5)
    draw = S.frame_sampler(sampler, torch.tensor([0]), torch.tensor([9]))
    codes = [int(draw(torch.zeros(1, 64))) for _ in range(15)]
    assert len(set(codes)) > 5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_thresholds_keep_the_plain_candidates(dtype):
    # The top-k / top-p thresholds are found by bisection over integer keys: 32-bit keys of the scores,
    # or for bf16 logits the logits' own 16 bits. Either must keep exactly the plain path's candidates.
    # Hot temperatures spread the draws over the kept set, so a threshold one candidate off changes some
    # of the 64 draws.
    vocab = 256
    cases = [
        StageSampling(temperature=2.0, top_k=k, top_p=p) for k in (1, 2, 7, 50, 255) for p in (1.0, 0.9, 0.3)
    ] + [StageSampling(temperature=3.0, top_k=0, top_p=0.99), StageSampling(temperature=1e-3, top_k=3)]
    n = len(cases)
    plain = S.StageSampler("code_predictor", n, vocab, history=False)
    fused = S.StageSampler("code_predictor", n, vocab, history=False, fused=True)
    # the same draws without top-p: where its winner differs, the kernel's race ran again above it
    no_top_p = S.StageSampler("code_predictor", n, vocab, history=False)
    for slot, s in enumerate(cases):
        for sampler in (plain, fused):
            sampler.assign(slot, s, seed=77 + slot)
        no_top_p.assign(slot, s.model_copy(update={"top_p": 1.0}), seed=77 + slot)
    g = torch.Generator().manual_seed(3)
    slots = torch.arange(n)
    races_again = 0
    for step in range(4):
        # distinct values (a permutation of a grid), so that no top-p boundary falls inside a tie
        grid = torch.linspace(-4, 4, vocab) * (1 + step % 2)
        logits = grid[torch.argsort(torch.rand(n, vocab, generator=g), dim=1)].to(dtype)
        keys = torch.full((n,), 7 * step) + slots
        want = plain(logits, slots, keys)
        assert fused(logits, slots, keys).tolist() == want.tolist()
        races_again += int((no_top_p(logits, slots, keys) != want).sum())
    assert races_again >= 5  # top-p turned the first winner away in these draws, and the kernel agreed
