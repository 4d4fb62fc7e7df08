"""omni_rt on Ray Serve: many GPUs and machines behind one endpoint (`pip install omni-rt[ray]`).

    serve run omni_rt.cluster:app             # defaults: tiny on the CPU, one replica, port 8080
    serve run omni_rt.cluster:build_app replicas=2 max_sessions=8 ...
    omni-rt serve --ray --replicas 2          # or --autoscale 1,8

Never imported by the core: `import omni_rt` does not import Ray. See docs/deployment.md.
"""

from __future__ import annotations

from typing import Any

from omni_rt.cluster.settings import ClusterSettings

__all__ = ["ClusterSettings", "app", "build", "build_app"]


def __getattr__(name: str) -> Any:
    # Importing the package (for ClusterSettings, the command line) needs no Ray; the app does.
    if name in ("build", "build_app"):
        from omni_rt.cluster import app as module

        return getattr(module, name)
    if name == "app":
        from omni_rt.cluster.app import build

        return build(ClusterSettings())
    raise AttributeError(f"module 'omni_rt.cluster' has no attribute {name!r}")
