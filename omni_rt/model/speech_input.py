"""Speech input for the Thinker: a user turn with audio -> prompt ids, input embeddings, M-RoPE positions.

Pure functions between the audio encoder (`audio_encoder.py`) and the Thinker; no scheduling.

    x = thinker_input(thinker, encoder, prompt_ids, cfg.ids, audio=[audio])  # any chat prompt: all below
    x = speech_turn_input(thinker, encoder, [audio], cfg.ids, text_ids=question_ids)  # a new spoken turn
    feats = log_mel(audio)                                             # [128, F] (omni_rt.audio.features)
    n = audio_token_count(feats.shape[1])                              # Thinker placeholders for the clip
    prompt = speech_prompt(cfg.ids, [n], text_ids=question_ids)        # chat prompt ids [T]
    x = build_speech_input(thinker, encoder, prompt, [feats], cfg.ids) # SpeechInput
    logits, hidden = thinker(None, x.positions, cache, slots, cfg.accept_hidden_layer,
                             inputs_embeds=x.inputs_embeds, rope_positions=x.rope_positions)
    talker_prompt(talker, thinker.embed, prompt, speaker, first_token, prompt_hidden=hidden[0])

How the reference lays out a clip (the processor's `replace_multimodal_special_tokens` and the Thinker's
`get_rope_index`): `<|audio_start|>`, one `<|audio_pad|>` per encoder token (`audio_token_count` of the
clip's mel frames, ~13 per second), `<|audio_end|>`, inside a user turn. The encoder's tokens replace the
placeholders' embeddings in order (`masked_scatter`). M-RoPE positions of text, audio_start, the audio
tokens and audio_end all advance by one per token and are equal across (t, h, w): for prompts of text
and audio only they are exactly 0, 1, ..., T-1 (`mrope_positions` computes them segment by segment, as
the reference does, and the tests check both), so the Thinker and Talker need no `rope_positions` for
speech input and decoding continues at position T. The Talker reads the Thinker's
`hidden_states[accept_hidden_layer]` at the placeholder positions (`multimodal_mask`) through
`hidden_projection` (`talker.talker_prompt_prefix(prompt_hidden=...)`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from omni_rt.audio.features import SAMPLE_RATE, audio_token_count, log_mel
from omni_rt.errors import InvalidRequestError
from omni_rt.model.config import TokenIds
from omni_rt.model.device_ids import to_device

__all__ = [
    "SpeechInput",
    "audio_segment",
    "audio_spans",
    "build_speech_input",
    "expand_audio_placeholders",
    "mrope_positions",
    "multimodal_mask",
    "place_audio",
    "scatter_audio",
    "speech_prompt",
    "speech_turn_input",
    "thinker_input",
]


def audio_segment(n_tokens: int, ids: TokenIds) -> list[int]:
    """One clip in the prompt: `[audio_start, audio_pad x n_tokens, audio_end]`."""
    if n_tokens < 1:
        raise InvalidRequestError(f"an audio clip needs at least one token, got {n_tokens}")
    return [ids.audio_start, *([ids.audio] * n_tokens), ids.audio_end]


def _chat_turn(ids: TokenIds, text_ids: Sequence[int]) -> list[int]:
    """A user turn of text then the assistant header: `[im_start, user, \\n, *text, im_end, \\n, im_start, assistant, \\n]`."""
    head = [ids.im_start, ids.user, ids.newline]
    return [*head, *text_ids, ids.im_end, ids.newline, ids.im_start, ids.assistant, ids.newline]


def speech_prompt(
    ids: TokenIds,
    clip_tokens: Sequence[int],
    text_ids: Sequence[int] = (),
    history: Sequence[int] = (),
) -> list[int]:
    """A chat prompt whose last user turn holds audio clips, then text, then the assistant header.

    `[*history, im_start, user, \\n, <clip 1>, ..., <clip n>, *text_ids, im_end, \\n, im_start, assistant, \\n]`,
    the order Qwen3-Omni's chat template gives to a user message of audio items followed by text.
    `clip_tokens`: each clip's `audio_token_count`; `history`: earlier turns (a system turn, previous
    exchanges) as chat-formatted ids, verbatim.
    """
    return [*history, *place_audio(_chat_turn(ids, text_ids), clip_tokens, ids)]


def _ids_list(prompt_ids: Sequence[int] | torch.Tensor) -> list[int]:
    t = torch.as_tensor(prompt_ids)
    if t.dim() == 2 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 1 or t.numel() == 0 or t.is_floating_point():
        raise InvalidRequestError(
            f"prompt ids must be one non-empty integer sequence [T], got {tuple(t.shape)}"
        )
    return [int(x) for x in t.tolist()]


def audio_spans(prompt_ids: Sequence[int] | torch.Tensor, ids: TokenIds) -> list[tuple[int, int]]:
    """[(first, end)] of each clip's placeholder run (end exclusive), in order; checks the layout.

    Every `<|audio_start|>` must be followed by one or more `<|audio_pad|>` and then `<|audio_end|>`,
    and no placeholder may stand outside such a segment.
    """
    p = _ids_list(prompt_ids)
    spans, i = [], 0
    while i < len(p):
        if p[i] == ids.audio:
            raise InvalidRequestError(
                f"<|audio_pad|> at position {i} outside <|audio_start|> ... <|audio_end|>"
            )
        if p[i] != ids.audio_start:
            i += 1
            continue
        j = i + 1
        while j < len(p) and p[j] == ids.audio:
            j += 1
        if j == i + 1 or j == len(p) or p[j] != ids.audio_end:
            raise InvalidRequestError(
                f"the audio segment opened at position {i} must be <|audio_pad|> x n (n >= 1), then <|audio_end|>"
            )
        spans.append((i + 1, j))
        i = j + 1
    return spans


def expand_audio_placeholders(
    prompt_ids: Sequence[int] | torch.Tensor, clip_tokens: Sequence[int], ids: TokenIds
) -> list[int]:
    """Template form -> model form: each clip's single `<|audio_pad|>` becomes `clip_tokens[i]` of them.

    What the processor does to the chat template's text (one placeholder per audio item) once the
    feature lengths are known. A segment that already holds its clip's count is left as it is.
    """
    p = _ids_list(prompt_ids)
    spans = audio_spans(p, ids)
    if len(spans) != len(clip_tokens):
        raise InvalidRequestError(
            f"the prompt has {len(spans)} audio segments, {len(clip_tokens)} clips were given"
        )
    out, last = [], 0
    for k, ((a, b), n) in enumerate(zip(spans, clip_tokens, strict=True)):
        if n < 1:
            raise InvalidRequestError(f"an audio clip needs at least one token, got {n}")
        if b - a not in (1, n):
            raise InvalidRequestError(
                f"audio clip {k} makes {n} encoder tokens, but its segment (at {a - 1}) already has {b - a} "
                "<|audio_pad|> placeholders: give one per clip (template form) or exactly its count"
            )
        out += p[last:a] + [ids.audio] * int(n)
        last = b
    return out + p[last:]


def place_audio(
    prompt_ids: Sequence[int] | torch.Tensor, clip_tokens: Sequence[int], ids: TokenIds
) -> list[int]:
    """A chat prompt with the clips of its LAST user turn in model form (`clip_tokens[i]` placeholders each).

    If the prompt has no audio segments, the clips go at the start of the last user turn (right after
    `<|im_start|> user \\n`), before its text, as the chat template orders a message's audio and text.
    Otherwise its segments (template form or already expanded) must all lie in the last user turn, one
    per clip: placeholders elsewhere would have no audio to fill them.
    """
    p = _ids_list(prompt_ids)
    if len(clip_tokens) == 0:
        raise InvalidRequestError("speech input needs at least one audio clip")
    heads = [i for i in range(len(p) - 1) if p[i] == ids.im_start and p[i + 1] == ids.user]
    if not heads:
        raise InvalidRequestError("the prompt has no user turn (<|im_start|> user) to hold the audio")
    start = heads[-1]
    end = next((i for i in range(start + 1, len(p)) if p[i] == ids.im_start), len(p))
    spans = audio_spans(p, ids)
    outside = [a - 1 for a, b in spans if not start < a < end]
    if outside:
        raise InvalidRequestError(
            f"audio segments at positions {outside} lie outside the last user turn ({start}..{end - 1}); "
            "only that turn's clips are given"
        )
    if spans:
        return expand_audio_placeholders(p, clip_tokens, ids)
    at = start + 2
    if at >= len(p) or p[at] != ids.newline:
        raise InvalidRequestError(f"the user turn at {start} must open with <|im_start|> user \\n")
    audio = [t for n in clip_tokens for t in audio_segment(int(n), ids)]
    return p[: at + 1] + audio + p[at + 1 :]


def multimodal_mask(prompt_ids: Sequence[int] | torch.Tensor, ids: TokenIds) -> torch.Tensor:
    """[T] bool: audio, image and video placeholder positions (where the Talker reads Thinker hidden states)."""
    t = torch.as_tensor(prompt_ids)
    if t.dim() == 2 and t.shape[0] == 1:
        t = t[0]
    return (t == ids.audio) | (t == ids.image) | (t == ids.video)


def _check_counts(spans: list[tuple[int, int]], feature_lens: Sequence[int], n_window: int) -> None:
    if len(spans) != len(feature_lens):
        raise InvalidRequestError(
            f"the prompt has {len(spans)} audio segments but {len(feature_lens)} clips of features were given"
        )
    for k, ((a, b), n) in enumerate(zip(spans, feature_lens, strict=True)):
        want = int(audio_token_count(int(n), n_window))
        if b - a != want:
            raise InvalidRequestError(
                f"audio clip {k}: {n} mel frames make {want} encoder tokens, but its segment has {b - a} "
                "<|audio_pad|> placeholders (build the prompt with audio_token_count / speech_prompt)"
            )


def mrope_positions(
    prompt_ids: Sequence[int] | torch.Tensor,
    ids: TokenIds,
    feature_lens: Sequence[int] = (),
    n_window: int = 50,
) -> torch.Tensor:
    """M-RoPE positions [3, 1, T] (t, h, w) of a prompt of text and audio, as the reference computes them.

    Segment by segment (the reference's `get_rope_index` for audio): text runs, then per clip its
    `<|audio_start|>`, `audio_token_count(feature_lens[k])` audio tokens and `<|audio_end|>`, each
    continuing one past the previous maximum, the same in all three components. Checks that each clip's
    placeholder count matches its feature length. (The result is 0..T-1: see the module docstring.)
    """
    p = _ids_list(prompt_ids)
    spans = audio_spans(p, ids)
    _check_counts(spans, [int(n) for n in feature_lens], n_window)
    parts: list[torch.Tensor] = []
    nxt = 0  # the next free position: one past the maximum so far
    cursor = 0  # prompt index where the next text run starts
    for (a, b), n in zip(spans, feature_lens, strict=True):
        start = a - 1  # the clip's <|audio_start|>
        for length in (
            start - cursor,
            1,
            int(audio_token_count(int(n), n_window)),
            1,
        ):  # text, bos, audio, eos
            parts.append(torch.arange(nxt, nxt + length))
            nxt += length
        cursor = b + 1
    parts.append(torch.arange(nxt, nxt + len(p) - cursor))  # trailing text
    pos = torch.cat(parts)  # [T]
    return pos.view(1, 1, -1).expand(3, 1, -1).clone()


def scatter_audio(
    embeds: torch.Tensor, prompt_ids: Sequence[int] | torch.Tensor, audio_embeds: torch.Tensor, ids: TokenIds
) -> torch.Tensor:
    """embeds [T, H] (the prompt's token embeddings) with the audio placeholders' rows replaced, in order,
    by audio_embeds [N_audio, H] (the encoder's tokens of all clips, clip after clip) -> [T, H]."""
    mask = torch.as_tensor(prompt_ids).reshape(-1) == ids.audio  # [T]
    if embeds.dim() != 2 or embeds.shape[0] != mask.shape[0]:
        raise InvalidRequestError(f"embeds must be [T={mask.shape[0]}, H], got {tuple(embeds.shape)}")
    n = int(mask.sum())
    if audio_embeds.dim() != 2 or audio_embeds.shape != (n, embeds.shape[1]):
        raise InvalidRequestError(
            f"the prompt has {n} <|audio_pad|> placeholders: audio_embeds must be [{n}, {embeds.shape[1]}], "
            f"got {tuple(audio_embeds.shape)}"
        )
    return embeds.masked_scatter(mask.to(embeds.device).unsqueeze(-1), audio_embeds.to(embeds.dtype))


@dataclass(frozen=True)
class SpeechInput:
    """Thinker prefill inputs of one prompt (batch of one): text, or text with audio."""

    input_ids: torch.Tensor  # [1, T] the prompt, placeholders included (repetition history, Talker prompt)
    inputs_embeds: torch.Tensor  # [1, T, H] token embeddings with the audio tokens (if any) scattered in
    positions: torch.Tensor  # [1, T] cache rows 0..T-1
    rope_positions: torch.Tensor  # [3, 1, T] M-RoPE positions (equal to `positions` for text + audio)
    mm_mask: torch.Tensor  # [T] bool: where the Talker reads the Thinker's hidden states


@torch.no_grad()
def build_speech_input(
    thinker,
    encoder,
    prompt_ids: Sequence[int] | torch.Tensor,
    features: Sequence[torch.Tensor],
    ids: TokenIds,
    encoded: Sequence[torch.Tensor | None] | None = None,
) -> SpeechInput:
    """Encode the clips' log-mel features ([128, F_k] each, in prompt order) and build the Thinker's inputs.

    `thinker`: a `Thinker` (its `embed`); `encoder`: an `AudioEncoder`. The prompt must already hold
    `audio_token_count(F_k)` placeholders per clip (`speech_prompt`, `expand_audio_placeholders`).
    `encoded`: each clip's encoder tokens if already computed (a turn encoded while it was spoken,
    `SpeechStream`), else None; the encoder runs only when some clip has none, and then on all of them,
    so a result never mixes the two ways of encoding.
    """
    p = _ids_list(prompt_ids)
    if len(features) == 0:
        raise InvalidRequestError("build_speech_input needs the features of at least one clip")
    for k, f in enumerate(features):
        if f.dim() != 2:
            raise InvalidRequestError(f"features of clip {k} must be [n_mels, frames], got {tuple(f.shape)}")
    lens = [int(f.shape[1]) for f in features]
    rope = mrope_positions(p, ids, lens, encoder.cfg.n_window)  # also checks the placeholder counts
    w = thinker.model.embed_tokens.weight
    enc_w = encoder.proj2.weight
    if encoded is not None and len(encoded) == len(features) and all(e is not None for e in encoded):
        audio = torch.cat([e.to(enc_w.device, enc_w.dtype) for e in encoded])  # [N_audio, output_dim]
    else:
        feats = torch.cat([f.to(enc_w.device, enc_w.dtype) for f in features], dim=1)
        audio = encoder(feats, torch.tensor(lens))
    prompt = to_device(p, w.device)  # [T], no host sync (device_ids)
    x = scatter_audio(thinker.embed(prompt), prompt, audio.to(w.device), ids)  # [T, H]
    return _speech_input(prompt, x, ids, rope)


def _speech_input(
    prompt: torch.Tensor, embeds: torch.Tensor, ids: TokenIds, rope: torch.Tensor | None = None
) -> SpeechInput:
    """prompt [T], embeds [T, H] -> SpeechInput; rope [3, 1, T] defaults to 0..T-1 (text and audio)."""
    t = prompt.shape[0]
    positions = torch.arange(t, device=prompt.device)[None]  # [1, T]
    return SpeechInput(
        input_ids=prompt[None],
        inputs_embeds=embeds[None],
        positions=positions,
        rope_positions=(positions[None].expand(3, 1, t) if rope is None else rope).to(prompt.device),
        mm_mask=multimodal_mask(prompt, ids),
    )


@torch.no_grad()
def thinker_input(
    thinker,
    encoder,
    prompt_ids: Sequence[int] | torch.Tensor,
    ids: TokenIds,
    audio: Sequence | None = None,
    inputs_embeds: torch.Tensor | None = None,
    sample_rate: int = SAMPLE_RATE,
) -> SpeechInput:
    """The Thinker's prefill inputs for a chat prompt and what fills its placeholders, checked.

    - audio: raw clips (mono float or int16 PCM at 16 kHz) of the prompt's LAST user turn: features
      (`log_mel`), the prompt in model form (`place_audio`: the clips' segments are added to that turn,
      or its template-form segments expanded) and the encoded clips scattered in (`build_speech_input`).
      `encoder` (an `AudioEncoder`, `OmniModel.thinker.audio_tower`) may be None only without audio.
    - inputs_embeds [T, H] or [1, T, H]: precomputed embeddings of exactly `prompt_ids` (placeholders
      already filled, e.g. by `build_speech_input`); used as they are.
    - neither: a text prompt. Audio placeholders are then an error: nothing would fill them, and the
      Thinker would answer from the placeholder tokens' own embeddings.
    Image/video placeholders are always an error: omni_rt has no vision encoder, and their M-RoPE
    positions (a 3-D grid) are not the sequential ones every caller of this uses.
    The result's `input_ids` is the prompt the Thinker sees (the Talker's prompt, too).
    """
    p = _ids_list(prompt_ids)
    w = thinker.model.embed_tokens.weight
    vocab = w.shape[0]
    if min(p) < 0 or max(p) >= vocab:
        raise InvalidRequestError(f"prompt token ids must be in [0, {vocab}) (the Thinker's vocabulary)")
    if audio is not None and inputs_embeds is not None:
        raise InvalidRequestError("give audio or inputs_embeds, not both")
    if any(t in (ids.image, ids.video) for t in p):
        raise InvalidRequestError(
            "the prompt has image/video placeholders: omni_rt takes text and speech only"
        )
    if audio is not None:
        if isinstance(audio, (np.ndarray, torch.Tensor)):
            raise InvalidRequestError("audio is a list of clips (one array each): pass [clip]")
        if len(audio) == 0:
            raise InvalidRequestError("audio must hold at least one clip")
        if encoder is None:
            raise InvalidRequestError("this model has no audio encoder (its config has no audio_config)")
        feats = [log_mel(c, sample_rate) for c in audio]
        counts = [int(audio_token_count(f.shape[1], encoder.cfg.n_window)) for f in feats]
        return build_speech_input(thinker, encoder, place_audio(p, counts, ids), feats, ids)
    audio_spans(p, ids)  # the layout of any audio segments is checked either way
    prompt = to_device(p, w.device)  # [T], no host sync (device_ids)
    if inputs_embeds is not None:
        e = inputs_embeds[0] if inputs_embeds.dim() == 3 and inputs_embeds.shape[0] == 1 else inputs_embeds
        if tuple(e.shape) != (len(p), w.shape[1]):
            raise InvalidRequestError(
                f"inputs_embeds must be [T, H] = [{len(p)}, {w.shape[1]}] (one row per prompt token), "
                f"got {tuple(inputs_embeds.shape)}"
            )
        return _speech_input(prompt, e.to(w.device, w.dtype), ids)
    n_audio = p.count(ids.audio)
    if n_audio:
        raise InvalidRequestError(
            f"the prompt has {n_audio} <|audio_pad|> placeholders but no audio: pass the last user "
            "turn's clips (audio=[...]) or inputs_embeds that fill them"
        )
    return _speech_input(prompt, thinker.embed(prompt), ids)


def speech_turn_input(
    thinker,
    encoder,
    clips: Sequence,
    ids: TokenIds,
    text_ids: Sequence[int] = (),
    history: Sequence[int] = (),
    sample_rate: int = SAMPLE_RATE,
) -> SpeechInput:
    """Raw 16 kHz clips (float or int16 PCM) of one user turn -> the Thinker's inputs, in one call.

    The prompt is `speech_prompt`'s (history, the user turn with the clips then `text_ids`, the assistant
    header), in `SpeechInput.input_ids`; see `thinker_input`. Each clip's features are its own; the
    reference's processor, given several clips at once, zero-pads the shorter ones to the longest before
    the STFT, which changes their last frame (one clip per turn, the usual case, is identical).
    """
    prompt = [*history, *_chat_turn(ids, text_ids)]
    return thinker_input(thinker, encoder, prompt, ids, audio=clips, sample_rate=sample_rate)
