"""The head GEMV that chooses its own code (kernels/head_sample.py) against the head then the sampler.

Run in Triton's interpreter on the CPU on tiny's predictor (a 64-id vocabulary), as
tests/test_kernels_code_frame.py. The one launch reads back the logits the GEMV stored and chooses by the
same code as the separate argmax or sampler kernel, so a frame's codes are equal bit for bit.
"""

import pytest
import torch
from test_kernels_code_frame import inputs, predictor, run
from triton_env import needs_triton

from omni_rt.config import Sampling, StageSampling
from omni_rt.model import sampling as S
from omni_rt.model.talker import greedy

pytestmark = needs_triton


def frame(monkeypatch, cp, fused: bool, hidden, code0, sample_for):
    """The fused frame's codes with FUSED_HEAD_SAMPLE = fused, and the head launches it made."""
    from omni_rt.kernels import code_frame, head_sample

    launches = []
    launch = head_sample.head_choose
    with monkeypatch.context() as patch:
        patch.setattr(code_frame, "FUSED_HEAD_SAMPLE", fused)
        patch.setattr(head_sample, "head_choose", lambda *a: launches.append(a[3]) or launch(*a))
        codes, _, _ = run(cp, True, hidden, code0, sample_for())
    return codes, launches


def sampler_of(b: int):
    sampler = S.StageSampler("code_predictor", b, 64, history=False, fused=True)
    for slot in range(b):
        sampler.assign(slot, S.residual_code_sampling(Sampling().code_predictor), seed=50 + slot)
    slots, keys = torch.arange(b), torch.tensor([9, 10, 400][:b])
    return lambda: S.frame_sampler(sampler, slots, keys)  # a frame's draws, from group 0 on each call


@pytest.mark.parametrize(("dtype", "batch"), [(torch.float32, 1), (torch.bfloat16, 2)])
def test_greedy_head_equals_the_head_then_argmax(monkeypatch, dtype, batch):
    cp = predictor(dtype)
    hidden, code0 = inputs(batch, cp.cfg.hidden_size, dtype)
    want, none = frame(monkeypatch, cp, False, hidden, code0, lambda: greedy)
    got, launches = frame(monkeypatch, cp, True, hidden, code0, lambda: greedy)
    assert not none and launches == [batch] * 15  # every code group's head chose in its own launch
    assert got.tolist() == want.tolist()
    assert len(set(want.flatten().tolist())) > 4  # the codes vary: the check can fail


@pytest.mark.parametrize("batch", [1, 3])
def test_sampling_head_makes_the_samplers_draws(monkeypatch, batch):
    cp = predictor(torch.float32, seed=3)
    hidden, code0 = inputs(batch, cp.cfg.hidden_size, torch.float32)
    want, _ = frame(monkeypatch, cp, False, hidden, code0, sampler_of(batch))
    got, launches = frame(monkeypatch, cp, True, hidden, code0, sampler_of(batch))
    assert launches == [batch] * 15
    assert got.tolist() == want.tolist()
    if batch == 3:  # it did sample: the check can fail
        greedy_codes, _ = frame(monkeypatch, cp, True, hidden, code0, lambda: greedy)
        assert got.tolist() != greedy_codes.tolist()


def test_head_choice_observes_the_history_as_the_sampler_does():
    """One head launch alone, with what the code predictor lacks: a repetition penalty over a history
    the choice updates, and suppressed ids. Three draws in a row, so each reads the one before's mark."""
    from omni_rt.kernels.code_frame import CodeFrame
    from omni_rt.kernels.head_sample import head_choose

    cp = predictor(torch.bfloat16)
    frame = CodeFrame(cp)
    b, vocab = 3, cp.cfg.vocab_size
    s = StageSampling(temperature=1.5, top_k=20, top_p=0.9, repetition_penalty=1.3)
    samplers = []
    for _ in range(2):
        sampler = S.StageSampler("talker", b, vocab, suppress=[5, 6], fused=True)
        for slot in range(b):
            sampler.assign(slot, s if slot else StageSampling(do_sample=False, repetition_penalty=1.3), slot)
        samplers.append(sampler)
    slots, keys = torch.tensor([2, 0, 1]), torch.tensor([30, 31, 32])
    plain, fused = (S.FrameDraws(sampler, slots, keys) for sampler in samplers)
    w = frame.heads[0]
    blocks = frame._blocks("head", b)
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        x = torch.randn(b, w.shape[1], generator=g).to(torch.bfloat16)
        want = plain(frame._linear("head", x, w, b, norm=frame.final_norm))
        got = head_choose(frame, x, w, b, x.stride(0), fused, blocks)
        assert got.tolist() == want.tolist()
    assert torch.equal(samplers[1].seen, samplers[0].seen)  # observed alike
    assert samplers[0].seen.sum() > b  # the draws marked the histories
