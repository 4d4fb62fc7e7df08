"""What the cluster ingress adds to first audio, on loopback: the same replica reached through the
ingress and directly, interleaved in one run (docs/scaling.md has the figures).

    python3 scripts/cluster_latency.py [--replies 20] [--pings 200] [--json out.json]

Starts a local Ray cluster with one tiny replica (CPU) behind the ingress. Per path it measures
- first audio: `response.create` sent -> the first `response.output_audio.delta` received, per reply;
- a round trip with no model work: an unknown event type sent -> its `error` received, which is the
  relay's own cost without the model's noise.
"Direct" claims a slot from the replica deployment as the ingress does and opens the replica's session
socket itself, so the two paths differ by exactly the ingress hop.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


async def first_audio(ws, tokens: int) -> float:
    await ws.send(
        json.dumps(
            {
                "type": "conversation.item.create",
                "item": {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "hello"}],
                },
            }
        )
    )
    t0 = time.perf_counter()
    await ws.send(json.dumps({"type": "response.create", "response": {"max_output_tokens": tokens}}))
    first = None
    while True:
        ev = json.loads(await ws.recv())
        if ev["type"] == "response.output_audio.delta" and first is None:
            first = time.perf_counter() - t0
        if ev["type"] == "response.done":
            return 1000 * first


async def round_trip(ws) -> float:
    t0 = time.perf_counter()
    await ws.send(json.dumps({"type": "no.such.event"}))
    while json.loads(await ws.recv())["type"] != "error":
        pass
    return 1000 * (time.perf_counter() - t0)


async def measure(url: str, replica, replies: int, pings: int, tokens: int) -> dict:
    import websockets

    async def via_ingress():
        ws = await websockets.connect(f"{url.replace('http', 'ws')}/v1/realtime", max_size=None)
        assert json.loads(await ws.recv())["type"] == "session.created"
        return ws, None

    async def direct():
        claim = replica.claim.remote()
        slot = await claim.__anext__()
        ws = await websockets.connect(
            f"{slot['url']}?ticket={slot['ticket']}", max_size=None, compression=None
        )
        assert json.loads(await ws.recv())["type"] == "session.created"
        return ws, claim

    out: dict[str, dict[str, list[float]]] = {
        "ingress": {"ttfa": [], "rtt": []},
        "direct": {"ttfa": [], "rtt": []},
    }
    paths = {"ingress": await via_ingress(), "direct": await direct()}
    for _ in range(3):  # warm up both (first replies allocate)
        for ws, _ in paths.values():
            await first_audio(ws, tokens)
    for i in range(replies):
        for name in ("ingress", "direct") if i % 2 == 0 else ("direct", "ingress"):
            out[name]["ttfa"].append(await first_audio(paths[name][0], tokens))
    for i in range(pings):
        for name in ("ingress", "direct") if i % 2 == 0 else ("direct", "ingress"):
            out[name]["rtt"].append(await round_trip(paths[name][0]))
    for ws, claim in paths.values():
        await ws.close()
        if claim is not None:
            claim.cancel()
    return out


def summary(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"n": len(xs), "p50": statistics.median(xs), "p95": xs[int(0.95 * (len(xs) - 1))], "min": xs[0]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replies", type=int, default=20)
    p.add_argument("--pings", type=int, default=200)
    p.add_argument("--tokens", type=int, default=4)
    p.add_argument("--json", default=None)
    args = p.parse_args()

    import ray
    from ray import serve

    from omni_rt.cluster import ClusterSettings, build
    from omni_rt.cluster.app import REPLICA

    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}},
    )
    try:
        settings = ClusterSettings(replicas=1, max_sessions=2, port=0, max_audio_seconds=0.8)
        ingress = serve.run(build(settings), name=settings.app_name, route_prefix=None)
        url = ingress.endpoint.remote().result()
        deadline = time.monotonic() + 60
        while ingress.health.remote().result()["replicas"] < 1:
            if time.monotonic() > deadline:
                raise SystemExit("the replica never reported")
            time.sleep(0.1)
        replica = serve.get_deployment_handle(REPLICA, settings.app_name).options(stream=True)
        raw = asyncio.run(measure(url, replica, args.replies, args.pings, args.tokens))
    finally:
        serve.shutdown()
        ray.shutdown()
    result = {path: {k: summary(v) for k, v in m.items()} for path, m in raw.items()}
    for kind in ("ttfa", "rtt"):
        # Back-to-back pairs (the order alternates): the median of their differences cancels most of
        # what a shared, busy CPU adds to both.
        pairs = [a - b for a, b in zip(raw["ingress"][kind], raw["direct"][kind], strict=True)]
        result[f"paired_{kind}_ms"] = summary(pairs)
        i, d = result["ingress"][kind], result["direct"][kind]
        print(f"{kind}: paired difference (ingress - direct) p50 {statistics.median(pairs):+.2f} ms")
        print(
            f"{kind}: ingress p50 {i['p50']:.2f} ms (p95 {i['p95']:.2f}), direct p50 {d['p50']:.2f} ms "
            f"(p95 {d['p95']:.2f}); added p50 {i['p50'] - d['p50']:+.2f} ms"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": result, "raw": raw}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
