"""The audio encoder equals transformers' Qwen3OmniMoeAudioEncoder; OmniModel holds it as
`thinker.audio_tower`, loads it strictly from a checkpoint and fills it with usable random weights."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch
from hf_fixtures import SMALL_CONFIGS, reinit_

from omni_rt.audio.features import audio_token_count
from omni_rt.errors import ConfigError, InvalidRequestError, WeightError
from omni_rt.model.audio_encoder import (
    CHECKPOINT_PREFIX,
    AudioEncoder,
    AudioEncoderConfig,
)
from omni_rt.model.omni import OmniModel

# n_window must stay 50: the reference's token count assumes 13 tokens per 100-frame window.
# n_window_infer 200: attention blocks of 2 windows (26 tokens), so long clips span several blocks.
SMALL = AudioEncoderConfig(
    num_mel_bins=128,
    d_model=32,
    encoder_layers=2,
    encoder_attention_heads=4,
    encoder_ffn_dim=48,
    downsample_hidden_size=8,
    output_dim=24,
    n_window=50,
    n_window_infer=200,
    max_source_positions=64,
)


def make_pair(cfg: AudioEncoderConfig, seed: int = 0):
    """(reference encoder, ours with the same weights), fp32, eval."""
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeAudioEncoderConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeAudioEncoder

    hf_cfg = Qwen3OmniMoeAudioEncoderConfig(**asdict(cfg))
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    ref = Qwen3OmniMoeAudioEncoder(hf_cfg).float().eval()
    reinit_(ref, seed)  # fan-in init: every layer matters (see hf_fixtures)
    ours = AudioEncoder(cfg).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours


@pytest.fixture(scope="module")
def pair():
    return make_pair(SMALL)


def feats(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(128, n, generator=torch.Generator().manual_seed(seed))


def test_state_dict_keys_equal_reference(pair):
    ref, ours = pair
    assert set(ours.state_dict()) == set(ref.state_dict())
    for k, v in ref.state_dict().items():
        assert ours.state_dict()[k].shape == v.shape, k


@pytest.mark.parametrize("lens", [[37], [100], [450], [1000, 73, 250]])
@torch.no_grad()
def test_forward_equals_reference(pair, lens):
    ref, ours = pair
    x = feats(sum(lens), seed=len(lens))
    n = torch.tensor(lens)
    want = ref(x, feature_lens=n).last_hidden_state
    got = ours(x, n)
    assert got.shape == (int(audio_token_count(n).sum()), SMALL.output_dim) == want.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert want.std() > 0.1  # a live signal, not a collapsed one


@torch.no_grad()
def test_clips_do_not_see_each_other(pair):
    _, ours = pair
    a, b = feats(230, 1), feats(120, 2)
    both = ours(torch.cat((a, b), dim=1), torch.tensor([230, 120]))
    na = audio_token_count(230)
    torch.testing.assert_close(both[:na], ours.encode(a), atol=1e-6, rtol=0)
    torch.testing.assert_close(both[na:], ours.encode(b), atol=1e-6, rtol=0)


@torch.no_grad()
def test_attention_is_blocked(pair):
    # changing frames in the third 2-second block (tokens 52..) leaves the first block's tokens unchanged
    _, ours = pair
    x = feats(500, 3)
    y = x.clone()
    y[:, 420:] += 1.0
    ex, ey = ours.encode(x), ours.encode(y)
    torch.testing.assert_close(ex[:52], ey[:52], atol=1e-6, rtol=0)
    assert not torch.allclose(ex[52:], ey[52:])


@torch.no_grad()
def test_tiny_preset_audio_config_equals_reference():
    cfg = AudioEncoderConfig.from_hf(SMALL_CONFIGS["tiny"].audio_config)
    ref, ours = make_pair(cfg, seed=5)
    x, n = feats(260, 5), torch.tensor([260])
    torch.testing.assert_close(ours(x, n), ref(x, feature_lens=n).last_hidden_state, atol=1e-5, rtol=1e-4)


def test_real_config_shapes_on_meta():
    from omni_rt.model.config import preset
    from omni_rt.model.omni import params_on_meta

    cfg = AudioEncoderConfig.from_hf(preset("qwen3-omni-30b-a3b").audio_config)
    assert cfg.output_dim == 2048 and cfg.conv_bins == 16 and cfg.encoder_layers == 32
    with params_on_meta():
        enc = AudioEncoder(cfg)
    n = sum(p.numel() for p in enc.parameters())
    assert 0.6e9 < n < 0.7e9  # "+0.65B audio encoder" (shared/reference/qwen3-omni.md)


@torch.no_grad()
def test_omni_model_loads_it_from_checkpoint(reference, checkpoint):
    ref = reference("tiny")
    model = OmniModel.build(SMALL_CONFIGS["tiny"], weights=checkpoint("tiny"))
    assert not any(n.startswith(CHECKPOINT_PREFIX) for n in model.load_report.skipped)
    x, n = feats(180, 7), torch.tensor([180])
    want = ref.thinker.audio_tower(x, feature_lens=n).last_hidden_state
    torch.testing.assert_close(model.thinker.audio_tower(x, n), want, atol=1e-5, rtol=1e-4)
    # from a mapping, in bf16
    bf16 = OmniModel.build(SMALL_CONFIGS["tiny"], dtype="bfloat16", weights=ref.state_dict())
    w = bf16.thinker.audio_tower.proj2.weight
    assert w.dtype == torch.bfloat16 and torch.equal(w, ref.thinker.audio_tower.proj2.weight.bfloat16())


def test_load_errors_name_the_encoder_tensor(reference):
    sd = dict(reference("tiny").state_dict())
    cfg = SMALL_CONFIGS["tiny"]
    missing = {k: v for k, v in sd.items() if "audio_tower.proj1" not in k}
    with pytest.raises(
        WeightError, match=r"thinker: 2 of \d+ tensors missing: thinker\.audio_tower\.proj1\.bias"
    ):
        OmniModel.build(cfg, weights=missing)
    bad = sd | {f"{CHECKPOINT_PREFIX}proj2.bias": torch.zeros(3)}
    with pytest.raises(WeightError, match=r"thinker\.audio_tower\.proj2\.bias: expected \[64\]"):
        OmniModel.build(cfg, weights=bad)
    # a checkpoint without the encoder (a text-only conversion) does not load into a model that has one
    no_audio = {k: v for k, v in sd.items() if not k.startswith(CHECKPOINT_PREFIX)}
    with pytest.raises(
        WeightError, match=r"thinker: \d+ of \d+ tensors missing: thinker\.audio_tower\.conv2d1"
    ):
        OmniModel.build(cfg, weights=no_audio)


def test_bad_input_is_a_typed_error(pair):
    _, ours = pair
    with pytest.raises(InvalidRequestError):
        ours(feats(50), torch.tensor([40]))  # lengths do not add up
    with pytest.raises(InvalidRequestError):
        ours(torch.randn(80, 50), torch.tensor([50]))  # wrong mel bins
    with pytest.raises(InvalidRequestError):
        ours(feats(50), torch.tensor([50, 0]))
    with pytest.raises(ConfigError):
        AudioEncoder({**asdict(SMALL), "activation_function": "relu"})


@torch.no_grad()
def test_random_encoder_is_seeded_and_alive():
    cfg = SMALL_CONFIGS["tiny"]
    a = OmniModel.build(cfg, weights="random", seed=3).thinker.audio_tower
    b = OmniModel.build(cfg, weights="random", seed=3).thinker.audio_tower
    c = OmniModel.build(cfg, weights="random", seed=4).thinker.audio_tower
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert float(a.ln_post.weight.min()) == 1.0 == float(a.layers[0].final_layer_norm.weight.max())
    assert float(a.layers[0].fc1.bias.abs().max()) == 0.0
    w = a.conv2d2.weight  # [ch, ch, 3, 3]: fan-in ch * 9
    assert abs(float(w.std()) * (w[0].numel() ** 0.5) - 1.0) < 0.1
    x = feats(300, 9)
    ya, yc = a.encode(x), c.encode(x)
    assert not torch.allclose(ya, yc)
    assert torch.isfinite(ya).all() and 0.3 < float(ya.std()) < 3  # O(1), like the text embeddings
    # different audio, different tokens: the front end passes the signal through
    assert (a.encode(feats(300, 10)) - ya).abs().mean() > 0.1 * ya.abs().mean()
