"""Small pieces the ingress and the replicas share: HTTP answers from the websockets handshake hook,
the address a replica listens on, and the cluster's `/metrics` (every replica's, labelled, and summed).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from http import HTTPStatus
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from websockets.datastructures import Headers
from websockets.http11 import Response

SUM_PREFIX = "omni_rt_cluster_"  # the summed families: omni_rt_sessions -> omni_rt_cluster_sessions


def http_response(status: HTTPStatus, body: bytes, content_type: str) -> Response:
    headers = Headers()
    headers["Content-Type"] = content_type
    headers["Content-Length"] = str(len(body))
    headers["Cache-Control"] = "no-cache"
    headers["Connection"] = "close"
    return Response(status.value, status.phrase, headers, body)


def replica_host() -> str:
    """This node's address as the rest of the cluster (and WebRTC clients) reach it: `OMNI_RT_NODE_HOST`
    when set (e.g. 127.0.0.1 for a one-machine cluster that must stay on loopback), else Ray's node IP."""
    import os

    import ray

    return os.environ.get("OMNI_RT_NODE_HOST") or ray.util.get_node_ip_address()


def merged_metrics(replicas: Mapping[str, str], *registries: CollectorRegistry) -> bytes:
    """Prometheus text of every replica's families with a `replica` label, the same families summed
    over replicas under SUM_PREFIX names (sessions, histograms, counters add up), and the ingress's own
    registries. `replicas`: replica id -> that replica's exposition text."""
    collector = _Merged(replicas)
    out = CollectorRegistry(auto_describe=False)
    out.register(collector)
    return generate_latest(out) + b"".join(generate_latest(r) for r in registries)


class _Merged:
    def __init__(self, replicas: Mapping[str, str]) -> None:
        self.replicas = replicas

    def collect(self) -> Iterable[Metric]:
        labelled: dict[str, Metric] = {}
        summed: dict[str, Metric] = {}
        totals: dict[str, dict[tuple[str, tuple], float]] = {}
        for replica, text in sorted(self.replicas.items()):
            for family in text_string_to_metric_families(text):
                name = family.name
                if name not in labelled:
                    labelled[name] = Metric(name, family.documentation, family.type)
                    if not name.endswith("_created"):  # a creation time: its sum means nothing
                        summed[name] = Metric(
                            _summed(name), f"{family.documentation} (all replicas)", family.type
                        )
                        totals[name] = {}
                for s in family.samples:
                    labelled[name].add_sample(s.name, {**s.labels, "replica": replica}, s.value)
                    if name in totals:
                        key = (s.name, tuple(sorted(s.labels.items())))
                        totals[name][key] = totals[name].get(key, 0.0) + s.value
        for name, samples in totals.items():
            for (sample, labels), value in samples.items():
                summed[name].add_sample(_summed(sample), dict(labels), value)
        yield from labelled.values()
        yield from summed.values()


def _summed(name: str) -> str:
    return SUM_PREFIX + name.removeprefix("omni_rt_")


def query_value(query: str, key: str) -> str:
    from urllib.parse import parse_qs

    return parse_qs(query).get(key, [""])[0]


def header(request: Any, name: str) -> str | None:
    """One header's value; a repeated one is a ValueError (which would count? neither)."""
    from websockets.datastructures import MultipleValuesError

    try:
        return request.headers.get(name)
    except MultipleValuesError:
        raise ValueError(f"repeated {name} header") from None
