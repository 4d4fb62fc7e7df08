"""Thinker vs the reference Qwen3OmniMoeThinkerForConditionalGeneration's text model, weights copied by name."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch

from omni_rt.errors import ConfigError, InvalidRequestError
from omni_rt.model.config import preset
from omni_rt.model.layers import KVCache
from omni_rt.model.thinker import Thinker

pytest.importorskip("transformers")
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as M  # noqa: E402
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (  # noqa: E402
    Qwen3OmniMoeConfig,
)

logging.getLogger("transformers").setLevel(logging.ERROR)

# `<|im_start|>user\nHello, how are you?<|im_end|>\n<|im_start|>assistant\n` as ids
CHAT = [151644, 872, 198, 9707, 11, 1246, 525, 498, 30, 151645, 198, 151644, 77091, 198]


def variant(name: str):
    """(OmniConfig, prompt ids) of a few shapes: the tiny preset and one with other widths/depths/experts."""
    cfg = preset("tiny")
    if name == "tiny":
        return cfg, CHAT
    th = replace(
        cfg.thinker,
        vocab_size=1000,
        hidden_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=24,
        norm_topk_prob=False,
        mrope_section=(6, 5, 5),
        rope_theta=1e6,
    )
    g = torch.Generator().manual_seed(3)
    return replace(cfg, thinker=th), torch.randint(0, 1000, (17,), generator=g).tolist()


_CACHE: dict = {}


def models(name: str):
    """(reference, ours, prompt) with our weights copied from the reference by name (built once per run)."""
    if name not in _CACHE:
        cfg, prompt = variant(name)
        torch.manual_seed({"tiny": 0, "wide": 1}[name])
        ref = M.Qwen3OmniMoeThinkerForConditionalGeneration(Qwen3OmniMoeConfig(**cfg.to_hf()).thinker_config)
        ref.eval()
        ours = Thinker(cfg.thinker).eval()
        text = {k: v for k, v in ref.state_dict().items() if k.startswith(("model.", "lm_head."))}
        ours.load_state_dict(text, strict=True)  # the same names, experts packed as in memory
        _CACHE[name] = (ref, ours, prompt)
    return _CACHE[name]


def prefill(th: Thinker, ids: list[int], cache, slot: int, **kw):
    x = torch.tensor([ids])
    pos = torch.arange(len(ids)).view(1, -1)
    return th(x, pos, cache, torch.tensor([slot]), **kw)


def greedy(th: Thinker, ids: list[int], n: int, cache=None, slot: int = 0) -> list[int]:
    cache = cache or th.allocate_cache(2, 64)
    logits, _ = prefill(th, ids, cache, slot, last_only=True)
    out = [int(logits[0, -1].argmax())]
    for i in range(n - 1):
        pos = torch.tensor([[len(ids) + i]])
        logits, _ = th(torch.tensor([[out[-1]]]), pos, cache, torch.tensor([slot]))
        out.append(int(logits[0, -1].argmax()))
    return out


@pytest.mark.parametrize("name", ["tiny", "wide"])
@torch.no_grad()
def test_logits_match_reference(name):
    ref, ours, prompt = models(name)
    ids = torch.tensor([prompt])
    want = ref(input_ids=ids).logits
    got, _ = prefill(ours, prompt, ours.allocate_cache(3, 40), slot=2)
    assert want.std() > 0.05  # varied logits, not a degenerate model
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["tiny", "wide"])
@torch.no_grad()
def test_greedy_generation_is_token_exact(name):
    ref, ours, prompt = models(name)
    n = 20
    want = ref.generate(input_ids=torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    want = want[0, len(prompt) :].tolist()
    got = greedy(ours, prompt, n)
    assert len(set(want)) > 5  # varied tokens make token-exactness a strong check
    assert got == want


@torch.no_grad()
def test_batch_of_two_decodes_like_solo():
    _, th, prompt = models("tiny")
    a, b = prompt, prompt[:3] + [9707, 1879, 0, 3555, 151645, 198]  # 14 and 9 tokens
    n = 8
    solo = [greedy(th, a, n, th.allocate_cache(3, 64), 1), greedy(th, b, n, th.allocate_cache(3, 64), 2)]

    cache = th.allocate_cache(3, 64)
    cache.k.normal_()  # stale rows of earlier occupants must not leak in
    cache.v.normal_()
    # one batched, right-padded prefill; logits taken at each row's last real token
    t = max(len(a), len(b))
    ids = torch.tensor([a + [0] * (t - len(a)), b + [0] * (t - len(b))])
    pos = torch.arange(t).view(1, t).expand(2, -1)
    slots = torch.tensor([1, 2])
    logits, _ = th(ids, pos, cache, slots, logits_index=torch.tensor([len(a) - 1, len(b) - 1]))
    assert logits.shape == (2, 1, th.cfg.vocab_size)
    toks = logits[:, -1].argmax(-1)  # [2]
    got = [[int(toks[0])], [int(toks[1])]]
    for i in range(n - 1):
        pos = torch.tensor([[len(a) + i], [len(b) + i]])
        logits, _ = th(toks.view(2, 1), pos, cache, slots)
        toks = logits[:, -1].argmax(-1)
        got[0].append(int(toks[0]))
        got[1].append(int(toks[1]))
    assert got == solo
    assert solo[0] != solo[1]


@pytest.mark.parametrize("name", ["tiny", "wide"])
@torch.no_grad()
def test_hidden_layer_equals_reference_hidden_states(name):
    ref, ours, prompt = models(name)
    want = ref(input_ids=torch.tensor([prompt]), output_hidden_states=True).hidden_states
    n_layers = ours.cfg.num_hidden_layers
    assert len(want) == n_layers + 1
    for k in range(n_layers + 1):
        _, hidden = prefill(ours, prompt, ours.allocate_cache(1, 32), 0, hidden_layer=k, last_only=True)
        assert hidden.shape == (1, len(prompt), ours.cfg.hidden_size)
        torch.testing.assert_close(hidden, want[k], rtol=1e-5, atol=1e-5, msg=f"hidden_states[{k}]")


@torch.no_grad()
def test_inputs_embeds_and_mrope_positions_match_reference():
    ref, ours, prompt = models("tiny")
    t = len(prompt)
    g = torch.Generator().manual_seed(5)
    pos3 = torch.randint(0, 30, (3, 1, t), generator=g)  # distinct t/h/w, as for image/audio positions
    embeds = ours.embed(torch.tensor([prompt]))
    want = ref.lm_head(ref.model(inputs_embeds=embeds, position_ids=pos3).last_hidden_state)
    got, _ = ours(None, torch.arange(t).view(1, t), ours.allocate_cache(1, 32), torch.tensor([0]),
                  inputs_embeds=embeds, rope_positions=pos3)  # fmt: skip
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    plain, _ = prefill(ours, prompt, ours.allocate_cache(1, 32), 0)
    assert not torch.allclose(got, plain, atol=1e-3)  # the M-RoPE positions really were used


def test_bad_inputs_raise_typed_errors():
    _, th, prompt = models("tiny")
    cache = th.allocate_cache(2, 16)
    ids = torch.tensor([prompt[:4]])
    pos = torch.arange(4).view(1, 4)
    one = torch.tensor([0])
    cases = [
        dict(input_ids=None),  # neither ids nor embeds
        dict(input_ids=torch.tensor([[1.0, 2.0]]), positions=torch.arange(2).view(1, 2)),
        dict(input_ids=torch.tensor([[th.cfg.vocab_size]]), positions=torch.zeros(1, 1, dtype=torch.long)),
        dict(positions=torch.arange(3).view(1, 3)),
        dict(positions=pos + 14),  # beyond the cache length
        dict(slots=torch.tensor([2])),
        dict(slots=torch.tensor([0, 1])),
        dict(hidden_layer=th.cfg.num_hidden_layers + 1),
        dict(cache=KVCache(1, 2, 2, 16, 16)),  # a cache of another model
    ]
    for case in cases:
        kw = dict(input_ids=ids, positions=pos, cache=cache, slots=one) | case
        with pytest.raises(InvalidRequestError):
            th(**kw)
    with pytest.raises(ConfigError):
        Thinker(preset("tiny").code_predictor)  # a dense config is not a Thinker


@torch.no_grad()
def test_kv_len_bucket_gives_the_same_tokens():
    _, th, prompt = models("tiny")
    want = greedy(th, prompt, 6)
    cache = th.allocate_cache(1, 64)
    logits, _ = prefill(th, prompt, cache, 0, last_only=True, kv_len=16)
    got = [int(logits[0, -1].argmax())]
    for i in range(5):
        pos = torch.tensor([[len(prompt) + i]])
        bucket = 16 if len(prompt) + i < 16 else 32  # a static length bucket above every position
        logits, _ = th(torch.tensor([[got[-1]]]), pos, cache, torch.tensor([0]), kv_len=bucket)
        got.append(int(logits[0, -1].argmax()))
    assert got == want
    with pytest.raises(InvalidRequestError):  # a position at or beyond kv_len would be unseen
        th(torch.tensor([[1]]), torch.tensor([[16]]), cache, torch.tensor([0]), kv_len=16)
    with pytest.raises(InvalidRequestError):
        th(torch.tensor([[1]]), torch.tensor([[3]]), cache, torch.tensor([0]), kv_len=65)
