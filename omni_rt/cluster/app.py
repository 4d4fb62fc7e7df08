"""The Serve application: one ingress deployment in front of one engine deployment.

    serve run omni_rt.cluster:app                                  # tiny, 1 replica, port 8080
    serve run omni_rt.cluster:build_app model=/models/Qwen3-Omni replicas=4 host=0.0.0.0 token=T
    omni-rt serve --ray --replicas 4 --model /models/Qwen3-Omni      # the same, from omni-rt

Each engine replica asks Ray for `num_gpus` (1 for a checkpoint, 0 for tiny) and `num_cpus`; Ray places
them on the cluster's nodes. Autoscaling targets sessions in use per replica (Serve's ongoing requests,
since a conversation is one long request: see replica.py).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ray import serve
from ray.serve.config import AutoscalingConfig, RequestRouterConfig
from ray.serve.schema import LoggingConfig

from omni_rt.cluster.ingress import OmniIngress
from omni_rt.cluster.replica import OmniReplica
from omni_rt.cluster.settings import ClusterSettings

INGRESS = "OmniIngress"
REPLICA = "OmniReplica"
# Serve's router gives a replica 0.1 s to say its queue length before trying another; a replica busy
# with a model step on a loaded CPU can miss that, and a new conversation then waits for a retry.
ROUTER_ENV = {"RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "1.0"}
# A line per Serve call would be a line per load report, every second per replica.
QUIET = LoggingConfig(enable_access_log=False)


def build(settings: ClusterSettings) -> Any:
    """The bound application for `serve.run`."""
    scaling: dict[str, Any]
    if settings.autoscale is None:
        scaling = {"num_replicas": settings.replicas}
    else:
        low, high = settings.autoscale
        scaling = {
            "autoscaling_config": AutoscalingConfig(
                min_replicas=low,
                initial_replicas=max(low, 1),
                max_replicas=high,
                target_ongoing_requests=settings.target,
                # Conversations last minutes: react to a rise within seconds, shrink only after a lull.
                upscale_delay_s=5.0,
                downscale_delay_s=300.0,
            )
        }
    replica = serve.deployment(
        OmniReplica,
        name=REPLICA,
        # A session is an ongoing request: a full replica is never sent another.
        max_ongoing_requests=settings.max_sessions,
        graceful_shutdown_timeout_s=settings.grace_s,
        graceful_shutdown_wait_loop_s=1.0,
        health_check_period_s=2.0,
        health_check_timeout_s=10.0,
        request_router_config=RequestRouterConfig(
            request_router_class="omni_rt.cluster.routing:LeastSessionsRouter"
        ),
        ray_actor_options={
            "num_cpus": settings.num_cpus,
            "num_gpus": settings.gpus,
            # Before torch loads: its OpenMP pool is sized at import.
            "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(settings.torch_threads), **ROUTER_ENV}},
        },
        logging_config=QUIET,
        **scaling,
    )
    ingress = serve.deployment(
        OmniIngress,
        name=INGRESS,
        num_replicas=1,  # one public port; see docs/deployment.md for more than one
        max_ongoing_requests=10_000,  # its calls are the replicas' load reports
        graceful_shutdown_timeout_s=settings.grace_s + 5.0,  # its own draining: see OmniIngress.__del__
        # On the head node: the public endpoint is where the cluster's address says.
        ray_actor_options={
            "num_cpus": 0,
            "resources": {"node:__internal_head__": 0.001},
            "runtime_env": {"env_vars": ROUTER_ENV},
        },
        logging_config=QUIET,
    )
    # The replicas' arguments leave out how many there are: with `serve deploy` (a config file) a new
    # count is then a scale (Serve adds or drains replicas), not a new version that replaces them all.
    args = replace(settings, replicas=1, autoscale=None, target_sessions=None)
    return ingress.bind(replica.bind(args, INGRESS), args)


def build_app(args: dict[str, Any]) -> Any:
    """`serve run omni_rt.cluster:build_app key=value ...` (Serve's application builder)."""
    return build(ClusterSettings.from_args(args))
