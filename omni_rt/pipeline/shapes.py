"""The static shapes CUDA graphs are captured for, and how a call is fitted to one.

A graph replays fixed shapes, so every dimension a step varies in is bucketed: the cache rows it attends
over (`kv_bucket`), a prefill's padded length (`prefill_bucket`) and the number of rows in a batch
(`batch_bucket`). Few distinct values keep capture time and graph memory small; the padding a bucket adds
is cheap next to what a graph saves (one launch instead of hundreds).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def batch_buckets(max_rows: int) -> list[int]:
    """The batch sizes graphed for up to `max_rows` rows: every size up to 8, then multiples of 8, and
    `max_rows` itself.

    One graph per size 1..max_rows cost 32 captures per kv bucket per stage at 32 sessions; powers of two
    padded 5 rows to 8, and padding rows route through MoE experts of their own (the load protocol's
    8-conversation level went from 0 to 5 late replies of 36 on an H200, docs/performance.md). Here at
    most 7 rows are padding, above 8 rows, where a step already reads most experts."""
    sizes = list(range(1, min(max_rows, 8) + 1)) + list(range(16, max_rows, 8))
    return sizes if sizes[-1] == max_rows else sizes + [max_rows]


def batch_bucket(n: int, max_rows: int) -> int:
    """The graphed batch size a call of `n` rows runs at (`n` itself above `max_rows`: eager)."""
    return next((b for b in batch_buckets(max_rows) if b >= n), n)


def pad_rows(x: torch.Tensor, rows: int, fill) -> torch.Tensor:
    """x [n, ...] with `rows - n` rows of `fill` appended (x itself when n == rows)."""
    n = x.shape[0]
    if n == rows:
        return x
    return torch.cat((x, x.new_full((rows - n, *x.shape[1:]), fill)))


def kv_bucket(n: int, max_len: int, smallest: int = 256) -> int:
    """Cache rows a step attends over: the next power of two >= n (at least `smallest`), capped at the
    cache length. Few distinct values, so few graphs, and short caches are cheap to attend over."""
    b = smallest
    while b < n:
        b *= 2
    return min(b, max_len)


def kv_buckets(max_len: int) -> list[int]:
    """Every value `kv_bucket` takes for a cache of `max_len` rows (one graph each)."""
    lens = [kv_bucket(1, max_len)]
    while lens[-1] < max_len:
        lens.append(kv_bucket(lens[-1] + 1, max_len))
    return lens


def prefill_bucket(t: int, buckets: tuple[int, ...], max_len: int) -> int | None:
    """Padded length of a t-token prefill: the smallest bucket >= t, capped at the cache length; None
    above the largest bucket (that prefill runs eagerly, unpadded)."""
    for b in buckets:
        if b >= t:
            return min(b, max_len)
    return None


def prefill_lengths(buckets: tuple[int, ...], max_len: int) -> list[int]:
    """Every value `prefill_bucket` takes for a cache of `max_len` rows."""
    return sorted({min(b, max_len) for b in buckets})


def prefill_shapes(buckets: tuple[int, ...], max_len: int) -> list[tuple[int, int]]:
    """(padded T, kv_len) of every prefill graph: a prefill of T tokens from position p attends over
    kv_bucket(p + T) >= kv_bucket(T) rows, so one graph per such pair."""
    return [
        (t, kv_len)
        for t in prefill_lengths(buckets, max_len)
        for kv_len in kv_buckets(max_len)
        if kv_len >= kv_bucket(t, max_len)
    ]


def prefill_plan(graphs: dict, batch: int, t: int, start: int, buckets: tuple[int, ...], max_len: int):
    """(T, kv_len, graph) for a prefill of `batch` rows of at most `t` new tokens from position at most
    `start`: the captured graph (key (batch, T, kv_len)) of the bucket T >= t when one fits, else
    (t, kv_bucket(start + t), None) to run eagerly. Padded positions must stay inside the cache: clamped
    to its last row instead, they could overwrite a real token's row in the same call."""
    padded = prefill_bucket(t, buckets, max_len) if graphs else None
    if padded is not None and start + padded <= max_len:
        kv_len = kv_bucket(start + padded, max_len)
        graph = graphs.get((batch, padded, kv_len))
        if graph is not None:
            return padded, kv_len, graph
    return t, kv_bucket(start + t, max_len), None


def batch_prefill_plan(
    graphs: dict, starts: Sequence[int], lengths: Sequence[int], buckets: tuple[int, ...], max_len: int
):
    """`prefill_plan` of one right-padded prefill of rows that write `lengths[j]` tokens from
    `starts[j]`, or None when the padding of some row would run past the cache's end unless they prefill
    one at a time (one row out of range is its own error: the cache's check names it)."""
    t, start = max(lengths), max(starts)
    plan = prefill_plan(graphs, len(lengths), t, start, buckets, max_len)
    if plan[2] is None and len(lengths) > 1 and start + t > max_len:
        return None
    return plan


def prefill_batches(most: int, max_rows: int, batched: bool) -> range:
    """Batch sizes of the prefill graphs (`EngineSettings.prefill_graph_batches`): 1 unless arrivals
    share their prefill calls (`EngineSettings.batch_starts`)."""
    return range(1, min(most, max_rows) + 1) if batched else range(1, 2)


def graphed_batches(
    rows: list, most: int, plan: Callable[[list], tuple | None], graphs_on: bool
) -> list[list]:
    """`rows` that arrived together as calls. `plan(batch)`: the batch's prefill plan, its graph last (None:
    none captured), or None where the batch's padding would not fit the cache (then one call per row).
    One call where graphs are off (an eager batch costs less than its rows one by one) or the whole
    batch has a graph; else runs of `most` rows that each have one; else one call per row. A batch
    without a graph would run eagerly on a GPU: two 57-token Thinker prefills took 125-178 ms batched
    eagerly under load on an H200, against 22 ms each graphed alone, holding every other conversation's
    step meanwhile."""
    singles = [[r] for r in rows]
    if len(rows) <= 1:
        return [list(rows)]
    whole = plan(rows)
    if whole is None:
        return singles
    if not graphs_on or whole[-1] is not None:
        return [list(rows)]
    spans = [rows[j : j + most] for j in range(0, len(rows), most)]
    if most > 1 and all(len(sp) == 1 or plan(sp)[-1] is not None for sp in spans):
        return spans
    return singles


def right_pad(x: torch.Tensor, t: int) -> torch.Tensor:
    """x [B, n, H] with zero rows appended to [B, t, H] (x itself when n == t)."""
    if x.shape[1] == t:
        return x
    out = x.new_zeros(x.shape[0], t, x.shape[2])
    out[:, : x.shape[1]] = x
    return out


def code2wav_buckets(max_rows: int) -> list[int]:
    """Rows a batched Code2Wav call is padded to: powers of two, and `max_rows` (a padding row costs a
    small conv stack's work, not, as a Thinker row does, MoE experts of its own)."""
    sizes = [1]
    while sizes[-1] < max_rows:
        sizes.append(min(2 * sizes[-1], max_rows))
    return sizes
