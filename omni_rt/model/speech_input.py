"""Speech input for the Thinker: a user turn with audio -> prompt ids, input embeddings, M-RoPE positions.

Pure functions between the audio encoder (`audio_encoder.py`) and the Thinker; no scheduling.

    x = speech_turn_input(thinker, encoder, [audio], cfg.ids, text_ids=question_ids)  # all of the below
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

import torch

from omni_rt.audio.features import SAMPLE_RATE, audio_token_count, log_mel
from omni_rt.errors import InvalidRequestError
from omni_rt.model.config import TokenIds

__all__ = [
    "SpeechInput",
    "audio_segment",
    "audio_spans",
    "build_speech_input",
    "expand_audio_placeholders",
    "mrope_positions",
    "multimodal_mask",
    "scatter_audio",
    "speech_prompt",
    "speech_turn_input",
]


def audio_segment(n_tokens: int, ids: TokenIds) -> list[int]:
    """One clip in the prompt: `[audio_start, audio_pad x n_tokens, audio_end]`."""
    if n_tokens < 1:
        raise InvalidRequestError(f"an audio clip needs at least one token, got {n_tokens}")
    return [ids.audio_start, *([ids.audio] * n_tokens), ids.audio_end]


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
    if len(clip_tokens) == 0:
        raise InvalidRequestError("a speech prompt needs at least one audio clip")
    audio = [t for n in clip_tokens for t in audio_segment(int(n), ids)]
    return [
        *history,
        ids.im_start,
        ids.user,
        ids.newline,
        *audio,
        *text_ids,
        ids.im_end,
        ids.newline,
        ids.im_start,
        ids.assistant,
        ids.newline,
    ]


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
    feature lengths are known.
    """
    p = _ids_list(prompt_ids)
    spans = audio_spans(p, ids)
    if len(spans) != len(clip_tokens):
        raise InvalidRequestError(
            f"the prompt has {len(spans)} audio segments, {len(clip_tokens)} clips were given"
        )
    out, last = [], 0
    for (a, b), n in zip(spans, clip_tokens, strict=True):
        if n < 1:
            raise InvalidRequestError(f"an audio clip needs at least one token, got {n}")
        if b - a != 1:
            raise InvalidRequestError(
                f"audio segment at {a - 1} already has {b - a} placeholders; expand a template-form prompt"
            )
        out += p[last:a] + [ids.audio] * int(n)
        last = b
    return out + p[last:]


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
    """Thinker prefill inputs of one prompt with audio (batch of one)."""

    input_ids: torch.Tensor  # [1, T] the prompt, placeholders included (repetition history, Talker prompt)
    inputs_embeds: torch.Tensor  # [1, T, H] token embeddings with the audio tokens scattered in
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
) -> SpeechInput:
    """Encode the clips' log-mel features ([128, F_k] each, in prompt order) and build the Thinker's inputs.

    `thinker`: a `Thinker` (its `embed`); `encoder`: an `AudioEncoder`. The prompt must already hold
    `audio_token_count(F_k)` placeholders per clip (`speech_prompt`, `expand_audio_placeholders`).
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
    audio = encoder(torch.cat([f.to(enc_w.device, enc_w.dtype) for f in features], dim=1), torch.tensor(lens))
    prompt = torch.tensor(p, device=w.device)  # [T]
    x = scatter_audio(thinker.embed(prompt), prompt, audio.to(w.device), ids)  # [T, H]
    t = len(p)
    return SpeechInput(
        input_ids=prompt[None],
        inputs_embeds=x[None],
        positions=torch.arange(t, device=w.device)[None],
        rope_positions=rope.to(w.device),
        mm_mask=multimodal_mask(prompt, ids),
    )


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

    Features per clip (`log_mel`), placeholders per clip (`audio_token_count`), the prompt
    (`speech_prompt`: history, the user turn with the clips then `text_ids`, the assistant header) and
    `build_speech_input`. The prompt is `SpeechInput.input_ids`. Each clip's features are its own; the
    reference's processor, given several clips at once, zero-pads the shorter ones to the longest before
    the STFT, which changes their last frame (one clip per turn, the usual case, is identical).
    """
    if len(clips) == 0:
        raise InvalidRequestError("a speech turn needs at least one audio clip")
    feats = [log_mel(c, sample_rate) for c in clips]
    counts = [int(audio_token_count(f.shape[1], encoder.cfg.n_window)) for f in feats]
    prompt = speech_prompt(ids, counts, text_ids=text_ids, history=history)
    return build_speech_input(thinker, encoder, prompt, feats, ids)
