"""Code2Wav: offline decode == transformers' reference; streaming decode == offline decode, sample for sample.

Models are small (hidden <= 64) so 100+ frames decode in about a second. Weights: every matrix and
kernel re-drawn as N(0, gain / sqrt(fan_in)) (tests/hf_fixtures.py), and, unlike there, every vector
too (layer scales, ConvNeXt gamma, SnakeBeta alpha/beta, norms, biases), so the attention window, the
ConvNeXt blocks and the snakes all shape the waveform. The last conv is calibrated to a waveform std of
0.25, so the [-1, 1] clamp rarely hides samples.

Tolerances. A random decoder amplifies fp32 rounding differences (CPU conv and GEMM kernels round
differently at different lengths), so the fp32 tests use gain 0.7, where the streamed and offline
decodes agree to ~1e-6; an fp64 test uses the fixture's gain 1.0 and shows the streamed decode is the
same function as the offline one (then only the float32 PCM output rounds, at most 1 ulp). No fp64
parity with the reference: its eager attention takes the softmax in fp32 whatever the dtype.
"""

from __future__ import annotations

import random
from dataclasses import replace
from functools import cache

import pytest
import torch
from hf_fixtures import _calibrate_code2wav_, reinit_

from omni_rt.errors import ConfigError, InvalidRequestError
from omni_rt.model.code2wav import Code2Wav
from omni_rt.model.code2wav_stream import Code2WavStream
from omni_rt.model.config import Code2WavConfig, preset

TINY = preset("tiny").code2wav  # hidden 64, 2 layers, window 72, decoder 64, the real upsampling (1920)
# GQA 3:1, 3 layers, a window of 8 frames, two decoder blocks of other rates, one upsampling ratio.
SMALL_WINDOW = replace(
    TINY,
    hidden_size=48,
    num_attention_heads=3,
    num_key_value_heads=1,
    num_hidden_layers=3,
    intermediate_size=96,
    sliding_window=8,
    rope_theta=500.0,
    layer_scale_initial_scale=0.1,
    decoder_dim=32,
    upsample_rates=(5, 3),
    upsampling_ratios=(3,),
)
# The real window of 72 frames with a short conv stack (8 samples a frame): long streams decode fast.
WINDOW72 = replace(TINY, decoder_dim=32, upsample_rates=(2, 2), upsampling_ratios=(2,))
CONFIGS = {"tiny": TINY, "small_window": SMALL_WINDOW, "window72": WINDOW72}
FRAMES = {"tiny": 80, "small_window": 40, "window72": 100}  # all longer than the window
FP32_ATOL = 1e-5


@cache
def models(name: str, gain: float = 0.7, dtype: torch.dtype = torch.float32):
    """(reference Qwen3OmniMoeCode2Wav, omni_rt Code2Wav) with equal weights, eval, in `dtype`."""
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

    cfg = CONFIGS[name]
    hf = Qwen3OmniMoeCode2WavConfig(**cfg.to_hf())
    hf._attn_implementation = "eager"  # plain math, independent of our SDPA path
    torch.manual_seed(0)
    ref = Qwen3OmniMoeCode2Wav(hf).float().eval()
    reinit_(ref, seed=0, gain=gain)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for pname, p in ref.named_parameters():
            if p.dim() != 1:
                continue
            r = torch.randn(p.shape, generator=g)
            if pname.endswith(("alpha", "beta")):
                p.copy_(0.3 * r)  # log-scale snake frequency and magnitude around 1
            elif pname.endswith(("layer_scale.scale", "gamma")):
                p.copy_(0.5 + 0.1 * r)  # residual branches matter (inits 0.01 and 1e-6 would mute them)
            elif pname.endswith("bias"):
                p.copy_(0.1 * r)
            else:  # norm weights
                p.copy_(1.0 + 0.1 * r)
    _calibrate_code2wav_(ref, seed=0)
    ref = ref.to(dtype)
    ours = Code2Wav(cfg).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours.to(dtype)


def random_codes(cfg: Code2WavConfig, frames: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.codebook_size, (batch, cfg.num_quantizers, frames), generator=g)


@torch.no_grad()
def stream_decode(model: Code2Wav, codes: torch.Tensor, chunks: list[int]) -> tuple[torch.Tensor, list[int]]:
    """Push codes [Q, N] in `chunks`; return (concatenated PCM, samples per push), flush included."""
    assert sum(chunks) == codes.shape[-1]
    stream = Code2WavStream(model)
    outs, start = [], 0
    for n in chunks:
        outs.append(stream.push(codes[:, start : start + n]))
        start += n
    outs.append(stream.flush())
    assert all(o.dtype == torch.float32 and o.dim() == 1 for o in outs)
    return torch.cat(outs), [o.numel() for o in outs]


def doubling(total: int) -> list[int]:
    out, n = [], 1
    while sum(out) + n < total:
        out.append(n)
        n *= 2
    return out + [total - sum(out)]


def random_chunks(total: int, seed: int, most: int) -> list[int]:
    rng, out = random.Random(seed), []
    while sum(out) < total:
        out.append(min(rng.randint(1, most), total - sum(out)))
    return out


# ---------------------------------------------------------------------------------------------------------
# Offline decode vs the reference


@pytest.mark.parametrize("name", list(CONFIGS))
def test_state_dict_matches_reference(name):
    ref, ours = models(name)
    want = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert got == want


@pytest.mark.parametrize("name", ["tiny", "small_window"])
def test_offline_matches_reference(name):
    ref, ours = models(name)
    cfg = CONFIGS[name]
    with torch.no_grad():
        for frames, batch in ((1, 1), (7, 2), (FRAMES[name], 1)):
            codes = random_codes(cfg, frames, seed=frames, batch=batch)
            want, got = ref(codes), ours(codes)
            assert got.shape == want.shape == (batch, 1, ours.output_length(frames))
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
            assert want.std() > 0.1  # a real waveform, not clamped flat or silent


def test_samples_per_frame_and_shortfall():
    with torch.device("meta"):  # real shapes without allocating 216M parameters
        real = Code2Wav(preset("qwen3-omni-30b-a3b").code2wav)
    assert (real.samples_per_frame, real.shortfall) == (1920, 555)
    assert real.output_length(1) == 1365 and real.output_length(10) == 19200 - 555
    _, small = models("small_window")
    # ratios (3,) then rates (5, 3): 45 samples a frame; look-ahead 1 input at rate 15, then 1 at 45
    assert (small.samples_per_frame, small.shortfall) == (45, (0 + 1) * 5 * 3 + 1 * 3)


def test_attention_reaches_beyond_25_frames():
    """Frame 10 changes the samples of frame 60 (inside the 72-frame window, outside a 25-frame
    context): the reference's chunked_decode with 25 frames of left context cannot be exact here, and
    the streaming tests below would catch a cache that forgets frames."""
    _, ours = models("window72")
    codes = random_codes(WINDOW72, 70, seed=3)
    other = codes.clone()
    other[:, :, 10] = (other[:, :, 10] + 1) % WINDOW72.codebook_size
    spf = ours.samples_per_frame
    with torch.no_grad():
        a, b = ours(codes)[..., 60 * spf : 61 * spf], ours(other)[..., 60 * spf : 61 * spf]
    assert (a - b).abs().max() > 1e-3


# ---------------------------------------------------------------------------------------------------------
# Streaming == offline


@cache
def offline_decode(name: str, frames: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    _, model = models(name)
    codes = random_codes(CONFIGS[name], frames, seed=seed)
    with torch.no_grad():
        return codes, model(codes)[0, 0]


def _chunkings(name: str) -> dict[str, list[int]]:
    n = FRAMES[name]
    over_window = CONFIGS[name].sliding_window + 3  # one chunk longer than the window
    return {
        "all_ones": [1] * n,
        "doubling": doubling(n),
        "by_25": [25] * (n // 25) + ([n % 25] if n % 25 else []),
        "random": random_chunks(n, seed=7, most=13),
        "longer_than_window": [1, over_window, n - 1 - over_window],
    }


STREAM_CASES = [
    (name, chunking)
    for name in ("window72", "small_window")
    for chunking in ("all_ones", "doubling", "by_25", "random", "longer_than_window")
] + [("tiny", "all_ones"), ("tiny", "longer_than_window")]  # the real conv stack: slower, two chunkings


@pytest.mark.parametrize(("name", "chunking"), STREAM_CASES)
def test_stream_equals_offline(name, chunking):
    _, model = models(name)
    codes, offline = offline_decode(name, FRAMES[name], seed=11)
    chunks = _chunkings(name)[chunking]
    streamed, sizes = stream_decode(model, codes[0], chunks)
    assert streamed.numel() == offline.numel() == model.output_length(FRAMES[name])
    # every push emits exactly the samples that its frames complete; flush has nothing left
    emitted = [model.output_length(f) for f in torch.tensor(chunks).cumsum(0).tolist()]
    assert sizes == [b - a for a, b in zip([0, *emitted], emitted, strict=False)] + [0]
    err = (streamed - offline).abs().max().item()
    assert err <= FP32_ATOL, f"streamed vs offline max |diff| {err:.2e}"


def test_stream_is_the_offline_function_in_fp64():
    _, model = models("tiny", gain=1.0, dtype=torch.float64)
    codes = random_codes(TINY, 30, seed=13)  # the real conv stack; the window is tested above
    with torch.no_grad():
        offline = model(codes)[0, 0].float()
    streamed, _ = stream_decode(model, codes[0], [1, 2, 4, 23])
    # the streamed PCM is float32: equal up to the rounding of the fp64 result (1 ulp below 1.0)
    torch.testing.assert_close(streamed, offline, atol=1.2e-7, rtol=0)


def test_first_frame_gives_its_final_samples():
    _, model = models("tiny")
    stream = Code2WavStream(model)
    pcm = stream.push(random_codes(TINY, 1)[0])
    assert pcm.numel() == model.samples_per_frame - model.shortfall == 1365
    assert pcm.abs().max() > 0


def test_stream_restarts_after_flush():
    _, model = models("small_window")
    a, b = random_codes(SMALL_WINDOW, 20, seed=1)[0], random_codes(SMALL_WINDOW, 15, seed=2)[0]
    stream = Code2WavStream(model)
    with torch.no_grad():
        first = torch.cat([stream.push(a[:, :9]), stream.push(a[:, 9:]), stream.flush()])
        second = torch.cat([stream.push(b[:, :4]), stream.push(b[:, 4:]), stream.flush()])
        torch.testing.assert_close(first, model(a[None])[0, 0], atol=FP32_ATOL, rtol=0)
        torch.testing.assert_close(second, model(b[None])[0, 0], atol=FP32_ATOL, rtol=0)


def test_batch_of_streams_with_a_late_start():
    """Two streams in lock step; stream 1 is restarted mid-way on a new utterance."""
    _, model = models("small_window")
    a = random_codes(SMALL_WINDOW, 25, seed=4)[0]
    b = random_codes(SMALL_WINDOW, 8, seed=5)[0]
    c = random_codes(SMALL_WINDOW, 17, seed=6)[0]
    stream = Code2WavStream(model, batch_size=2)
    out0, out1b, out1c = [], [], []
    with torch.no_grad():
        for i, (s, e) in enumerate(((0, 3), (3, 8), (8, 15), (15, 25))):
            if i == 2:
                stream.reset(1)
            second = b[:, s:e] if i < 2 else c[:, s - 8 : e - 8]
            p0, p1 = stream.push(torch.stack([a[:, s:e], second]))
            out0.append(p0)
            (out1b if i < 2 else out1c).append(p1)
        for got, codes in ((out0, a), (out1b, b), (out1c, c)):
            torch.testing.assert_close(torch.cat(got), model(codes[None])[0, 0], atol=FP32_ATOL, rtol=0)


@pytest.mark.parametrize("name", ["small_window", "tiny"])
def test_ragged_chunks_each_decode_their_own_stream(name):
    """One step, streams of different chunk sizes: each row's chunk is its first `valid` frames (the rest
    pad it with other codes), and each stream's own samples, chunk after chunk, are its offline decode.
    Sizes include 0 (the row waits), more than the attention window (small_window's 8), and rows whose
    padding would overwrite ring slots and conv context that their next chunk still reads."""
    _, model = models(name)
    cfg, spf, short = CONFIGS[name], model.samples_per_frame, model.shortfall
    plan = [[1, 3, 0], [2, 1, 10], [0, 4, 1], [11, 2, 3], [3, 0, 2]]  # per call: each stream's frames
    totals = [sum(c[i] for c in plan) for i in range(3)]
    streams = [random_codes(cfg, n, seed=20 + i)[0] for i, n in enumerate(totals)]
    state = model.new_state(3)
    out: list[list[torch.Tensor]] = [[], [], []]
    done = [0, 0, 0]
    with torch.no_grad():
        for sizes in plan:
            T = max(sizes)
            pad = random_codes(cfg, T, seed=99)[0]  # padding codes: anything
            codes = torch.stack([
                torch.cat([s[:, d : d + n], pad[:, n:]], dim=-1) for s, d, n in zip(streams, done, sizes, strict=True)
            ])  # fmt: skip
            state.valid = torch.tensor(sizes)
            wav = model.step(codes, state)[:, 0]
            for i, n in enumerate(sizes):
                own = wav[i, : spf * n]
                out[i].append(own[max(short - spf * done[i], 0) :] if n else own)
                done[i] += n
        assert state.pos.tolist() == totals
        for got, codes in zip(out, streams, strict=True):
            torch.testing.assert_close(torch.cat(got), model(codes[None])[0, 0], atol=FP32_ATOL, rtol=0)


# ---------------------------------------------------------------------------------------------------------
# Bad input


def test_bad_codes_are_rejected_and_leave_the_stream_intact():
    _, model = models("small_window")
    q, v = SMALL_WINDOW.num_quantizers, SMALL_WINDOW.codebook_size
    codes = random_codes(SMALL_WINDOW, 12, seed=8)[0]
    stream = Code2WavStream(model)
    first = stream.push(codes[:, :5])
    bad = [
        codes[: q - 1, :3],  # wrong number of quantizers
        codes[:, :0],  # empty push
        torch.full((q, 2), v),  # code out of range
        torch.full((q, 2), -1),  # negative code
        codes[:, :2].float(),  # not integer codes
        codes[:, 0],  # one frame without its frame axis
        codes[None, None, :, :2],  # too many axes
    ]
    for x in bad:
        with pytest.raises(InvalidRequestError):
            stream.push(x)
    assert issubclass(InvalidRequestError, ValueError)
    rest = stream.push(codes[:, 5:])
    with torch.no_grad():
        torch.testing.assert_close(torch.cat([first, rest]), model(codes[None])[0, 0], atol=FP32_ATOL, rtol=0)


def test_bad_offline_input_and_config():
    _, model = models("small_window")
    codes = random_codes(SMALL_WINDOW, 4)
    for x in (codes[:, :-1], codes[0], codes[..., :0], codes + SMALL_WINDOW.codebook_size):
        with pytest.raises(InvalidRequestError):
            model(x)
    with pytest.raises(InvalidRequestError):
        Code2WavStream(model, batch_size=2).push(codes[0])  # a batch stream wants [B, Q, n]
    with pytest.raises(ConfigError):
        Code2Wav(replace(SMALL_WINDOW, decoder_dim=30))  # not divisible by 2^blocks
