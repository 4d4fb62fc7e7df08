"""The benchmark's agreement and determinism checks: greedy by nature (a sampled reply has no single
right token), so they run on greedy passes beside the served, sampled rows and say so in their labels."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from omni_rt.bench_measure import Sample, timed_request


def token_agreement(a: Sequence[Sample], b: Sequence[Sample]) -> float | None:
    """Greedy text agreement of two rows: per prompt (first request of each), the fraction of positions
    whose token ids are equal (a length difference counts as disagreement), averaged over prompts."""
    first_a = {s.prompt_len: s.token_ids for s in reversed(a)}
    first_b = {s.prompt_len: s.token_ids for s in reversed(b)}
    fracs = []
    for n in sorted(first_a.keys() & first_b.keys()):
        x, y = first_a[n], first_b[n]
        if max(len(x), len(y)) == 0:
            continue
        fracs.append(sum(p == q for p, q in zip(x, y, strict=False)) / max(len(x), len(y)))
    return sum(fracs) / len(fracs) if fracs else None


@torch.no_grad()
def teacher_forced_agreement(
    model: Any, prompts: dict[int, list[int]], samples: Sequence[Sample], sampling: Any
) -> dict[str, Any] | None:
    """Greedy next-token agreement of the plain path with a row's replies, position by position.

    For the first request of each prompt, the model as it stands (the caller removes the kernels first)
    reads the prompt and the row's reply in one eager forward; at each reply position its greedy choice,
    after the engine's logits processing (the repetition penalty over all that came before), is compared
    with the token the row emitted. Unlike the free-running `token_agreement`, a flipped near-tie (random
    weights' logits are nearly flat) costs one position, not every later one: issue 2's per-position
    measure, applied to the fast path. Returns {"agreement" (averaged over prompts), "positions",
    "max_mismatch_ulps"}: the largest gap, in bf16 ulps of the plain path's top score, between the plain
    path's choice and the row's token where they differ (<= 1-2: a tie under bf16 rounding).
    """
    from omni_rt.model.sampling import StageSampler, process_logits

    thinker = model.thinker
    dev = thinker.lm_head.weight.device
    fracs, positions, worst = [], 0, 0.0
    for s in {s.prompt_len: s for s in reversed(samples)}.values():
        prompt, reply = prompts.get(s.prompt_len), s.token_ids
        if prompt is None or not reply:
            continue
        ids = torch.tensor(prompt + reply[:-1], device=dev)[None]  # [1, T]
        cache = thinker.allocate_cache(1, ids.shape[1])  # exactly T rows: the plain unmasked prefill
        slot = torch.zeros(1, dtype=torch.long, device=dev)
        logits, _ = thinker(ids, torch.arange(ids.shape[1], device=dev)[None], cache, slot)  # [1, T, V]
        # the Thinker's own sampling state, as the engine and generate_offline set it up: its settings
        # (greedy: the repetition penalty only) and the prompt as repetition history
        pick = StageSampler("thinker", 1, thinker.cfg.vocab_size, dev)
        pick.assign(0, sampling.thinker, 0, history_ids=torch.tensor(prompt, device=dev))
        agree = 0
        for i, tok in enumerate(reply):
            scores, _ = process_logits(logits[:, len(prompt) - 1 + i], pick.rows(slot), pick.seen[slot])
            top = scores[0].max()
            if scores[0, tok] == top:
                agree += 1
            else:
                ulp = 2.0 ** (torch.floor(torch.log2(top.abs().clamp_min(1e-30))).item() - 7)
                worst = max(worst, (top - scores[0, tok]).item() / ulp)
            pick.seen[0, tok] = True  # the row's token, not the plain path's choice, is the history
        fracs.append(agree / len(reply))
        positions += len(reply)
    if not fracs:
        return None
    return {"agreement": sum(fracs) / len(fracs), "positions": positions, "max_mismatch_ulps": worst}


async def determinism_check(
    engine: Any, ids: list[int], args: argparse.Namespace, samplings: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    """Per labelled sampling, in one engine start: the same request alone twice, then `c` copies at once;
    every run must give the same bits (token ids and PCM). Meaningful with `deterministic=True` in the
    engine's settings. Seeded sampling belongs here too: the same seed must give the same draws alone and
    in a batch."""
    out: dict[str, dict[str, Any]] = {}
    c = max(2, args.determinism_concurrency)
    async with engine:
        for label, sampling in samplings.items():
            runs: list[Sample] = []
            for _ in range(2):
                async with engine.session(voice=args.voice) as s:
                    runs.append(await timed_request(s, ids, args.text_tokens, args.frames, sampling))
            async with contextlib.AsyncExitStack() as stack:
                sessions = [
                    await stack.enter_async_context(engine.session(voice=args.voice)) for _ in range(c)
                ]
                runs += await asyncio.gather(
                    *(timed_request(s, ids, args.text_tokens, args.frames, sampling) for s in sessions)
                )
            ref = runs[0]
            same = [r.token_ids == ref.token_ids and r.pcm_sha1 == ref.pcm_sha1 for r in runs]
            out[label] = {
                "runs": len(runs),
                "alone_then_concurrent": [1, 1, c],
                "bit_identical": all(same),
                "identical_runs": sum(same),
                "text_tokens": ref.text_tokens,
                "pcm_sha1": ref.pcm_sha1,
            }
    return out
