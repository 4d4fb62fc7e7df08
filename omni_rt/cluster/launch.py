"""`omni-rt serve --ray`: the same server across a Ray cluster, from the same command line.

    omni-rt serve --ray --replicas 2                  # a local Ray cluster is started if none runs
    omni-rt serve --ray --autoscale 1,8 --model /models/Qwen3-Omni --host 0.0.0.0 --token T
    RAY_ADDRESS=ray://head:10001 omni-rt serve --ray ...   # or --address: a running cluster

Every `omni-rt serve` option means what it means there (`--max-sessions` is per replica); the cluster
adds how many replicas, what each asks of Ray, and the draining grace.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from omni_rt.cluster.settings import ClusterSettings, parse_autoscale


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, ClusterSettings]:
    from omni_rt.server.app import parse_args as serve_args

    p = argparse.ArgumentParser(
        prog="omni-rt serve --ray",
        description="Serve realtime sessions from engine replicas on a Ray cluster, behind one endpoint. "
        "Every `omni-rt serve` option applies too (--max-sessions is per replica).",
    )
    count = p.add_mutually_exclusive_group()
    count.add_argument("--replicas", type=int, default=None, help="a fixed number of replicas (default: 1)")
    count.add_argument("--autoscale", default=None, metavar="MIN,MAX", help="scale on sessions in use")
    p.add_argument(
        "--target-sessions",
        type=float,
        default=None,
        help="sessions per replica autoscaling aims at (default: 3/4 of --max-sessions)",
    )
    p.add_argument(
        "--num-gpus", type=float, default=None, help="GPUs per replica (default: 0 for tiny, else 1)"
    )
    p.add_argument("--num-cpus", type=float, default=1.0, help="CPUs per replica for Ray (default: 1)")
    p.add_argument("--torch-threads", type=int, default=1, help="torch threads per replica (default: 1)")
    p.add_argument("--grace", type=float, default=30.0, help="seconds a draining replica waits (default: 30)")
    p.add_argument(
        "--address", default=None, help="a running Ray cluster (default: RAY_ADDRESS, else a local one)"
    )
    ours, rest = p.parse_known_args(argv)
    shared = serve_args(rest)  # the single-process server's options, checked the same way
    try:
        settings = ClusterSettings(
            model=shared.model,
            device=shared.device,
            dtype=shared.dtype,
            max_sessions=shared.max_sessions,
            replicas=ours.replicas or 1,
            autoscale=parse_autoscale(ours.autoscale) if ours.autoscale else None,
            target_sessions=ours.target_sessions,
            num_gpus=ours.num_gpus,
            num_cpus=ours.num_cpus,
            torch_threads=ours.torch_threads,
            grace_s=ours.grace,
            host=shared.host,
            port=shared.port,
            token=shared.token,
            allowed_origins=tuple(shared.allow_origin),
            ice_servers=tuple(shared.ice_server),
            voice=shared.voice,
            max_audio_seconds=shared.max_audio_seconds,
            idle=shared.idle,
            extra=shared.engine_settings,  # --set KEY=VALUE, for every replica's engine
        )
    except ValueError as exc:
        p.error(str(exc))
    return ours, settings


def main(argv: Sequence[str] | None = None) -> int:
    ours, settings = parse_args(argv)
    try:
        import ray
        from ray import serve
    except ImportError:
        print("omni-rt serve --ray: Ray Serve is not installed: pip install 'omni-rt[ray]'", file=sys.stderr)
        return 1
    from omni_rt.cluster.app import build

    ray.init(address=ours.address, runtime_env=_runtime_env(), log_to_driver=False)
    try:
        print(f"omni-rt: starting {_count(settings)} of {settings.model} on Ray ...", flush=True)
        ingress = serve.run(build(settings), name=settings.app_name, route_prefix=None)
        endpoint = ingress.endpoint.remote().result()
        print(f"omni-rt: serving at {endpoint}/v1/realtime (health, metrics: {endpoint}/health, /metrics)")
        print("omni-rt: Ctrl-C to stop", flush=True)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
        serve.delete(settings.app_name)
    finally:
        ray.shutdown()
    print("omni-rt: stopped", flush=True)
    return 0


def _count(settings: ClusterSettings) -> str:
    if settings.autoscale is not None:
        return f"{settings.autoscale[0]}..{settings.autoscale[1]} replicas (autoscaling)"
    return f"{settings.replicas} replica{'s' if settings.replicas != 1 else ''}"


def _runtime_env() -> dict | None:
    """Run from a source checkout, omni_rt is not installed where the workers look: point them at it."""
    root = Path(__file__).resolve().parents[2]
    if "site-packages" in root.parts or "dist-packages" in root.parts:
        return None
    return {"env_vars": {"PYTHONPATH": str(root)}}
