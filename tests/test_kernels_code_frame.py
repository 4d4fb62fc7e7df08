"""The fused code-predictor frame (kernels/code_frame.py) against `CodePredictor.predict`'s plain frame.

Run in Triton's interpreter on the CPU at small shapes (tiny's predictor with a 64-id vocabulary). The
truth is the model's own frame. In fp32 the kernels' sums run in another order than PyTorch's, so the
hidden states agree to ~1e-6 and the codes, greedy or sampled with the same keyed draws, are equal; in
bf16 every intermediate is rounded where the plain path rounds, so the codes are equal too (these seeded
weights keep no two logits within an ulp) and the cache rows mostly bit-equal.
"""

import dataclasses

import pytest
import torch
from triton_env import needs_triton

from omni_rt.config import Sampling
from omni_rt.model import sampling as S
from omni_rt.model.config import preset
from omni_rt.model.talker import CodePredictor, greedy

pytestmark = needs_triton

GROUPS = 16


def predictor(dtype: torch.dtype, seed: int = 0) -> CodePredictor:
    cfg = dataclasses.replace(preset("tiny").code_predictor, vocab_size=64)
    cp = CodePredictor(cfg, GROUPS)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in cp.parameters():  # norm weights near 1, the rest spread enough that logits differ
            p.copy_(torch.randn(p.shape, generator=g) * (0.1 if p.dim() == 1 else 0.3) + (p.dim() == 1))
    return cp.to(dtype)


def inputs(batch: int, width: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(7)
    return (
        torch.randn(batch, width, generator=g).to(dtype),
        torch.randn(batch, width, generator=g).to(dtype),
    )


def run(cp: CodePredictor, fused: bool, hidden, code0, sample=greedy):
    from omni_rt.kernels.code_frame import CodeFrame

    cp.frame_fn = CodeFrame(cp) if fused else None
    cp.cache = None  # each run fills its own cache
    codes = cp.predict(hidden, code0, sample)
    return codes, cp.cache.k.clone(), cp.cache.v.clone()


@pytest.mark.parametrize("batch", [1, 3, 6])  # 6 rows x 2 positions: the tl.dot tiles of step 0
def test_fp32_frame_equals_the_plain_frame(batch):
    cp = predictor(torch.float32)
    hidden, code0 = inputs(batch, cp.cfg.hidden_size, torch.float32)
    want, k_want, v_want = run(cp, False, hidden, code0)
    got, k_got, v_got = run(cp, True, hidden, code0)
    assert got.tolist() == want.tolist()
    assert len(set(want.flatten().tolist())) > 8  # the codes vary: the check can fail
    torch.testing.assert_close(k_got, k_want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v_got, v_want, rtol=1e-5, atol=1e-5)


def test_bf16_frame_equals_the_plain_frame():
    cp = predictor(torch.bfloat16)
    hidden, code0 = inputs(2, cp.cfg.hidden_size, torch.bfloat16)
    want, k_want, _ = run(cp, False, hidden, code0)
    got, k_got, _ = run(cp, True, hidden, code0)
    assert got.tolist() == want.tolist()
    # rounded where the plain path rounds: the first layer's cache is bit-equal, the last's mostly (the
    # attention sums run in another order once a row sees several positions)
    assert torch.equal(k_got[0], k_want[0])
    assert (k_got == k_want).float().mean() > 0.9
    torch.testing.assert_close(k_got.float(), k_want.float(), atol=0.05, rtol=0.05)


def test_sampled_frame_makes_the_plain_draws():
    cp = predictor(torch.float32, seed=3)
    b = 3
    sampler = S.StageSampler("code_predictor", b, 64, history=False)
    for slot in range(b):
        sampler.assign(slot, S.residual_code_sampling(Sampling().code_predictor), seed=50 + slot)
    slots, keys = torch.arange(b), torch.tensor([9, 10, 400])
    hidden, code0 = inputs(b, cp.cfg.hidden_size, torch.float32)
    want, _, _ = run(cp, False, hidden, code0, S.frame_sampler(sampler, slots, keys))
    got, _, _ = run(cp, True, hidden, code0, S.frame_sampler(sampler, slots, keys))
    assert got.tolist() == want.tolist()
    greedy_codes, _, _ = run(cp, False, hidden, code0)
    assert got.tolist() != greedy_codes.tolist()  # it did sample


def test_install_sets_and_uninstall_clears_the_seam():
    from omni_rt.kernels import fused

    cp = predictor(torch.float32)
    host = torch.nn.Module()
    host.cp = cp
    assert fused.install_all(host, {"code_frame"}) == {"code_frame": 1}
    assert cp.frame_fn is not None
    assert fused.uninstall_all(host) == 1 and cp.frame_fn is None


def test_few_rows_path_over_several_row_and_k_blocks(monkeypatch):
    from omni_rt.kernels import code_frame

    monkeypatch.setitem(code_frame.GEMV_BLOCKS, "BM", 2)  # 3 rows (6 at step 0): several programs per column
    monkeypatch.setitem(code_frame.GEMV_BLOCKS, "BK", 32)  # K of 64 and 128 in several tiles
    monkeypatch.setattr(code_frame, "SMALL_M", 8)
    cp = predictor(torch.float32)
    hidden, code0 = inputs(3, cp.cfg.hidden_size, torch.float32)
    want, k_want, _ = run(cp, False, hidden, code0)
    got, k_got, _ = run(cp, True, hidden, code0)
    assert got.tolist() == want.tolist()
    torch.testing.assert_close(k_got, k_want, rtol=1e-5, atol=1e-5)
