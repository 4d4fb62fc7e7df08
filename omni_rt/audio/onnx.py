"""The ONNX models that packages from the registries ship, found and loaded without importing the package.

    path = packaged_file("silero-vad", "silero_vad/data/silero_vad.onnx")
    session = onnx_session(path)         # one per file and process, shared by every stream

A packaged model is found through the distribution's installed files (`importlib.metadata`), not by
importing it: `silero_vad` sets torch's global thread count on import, and `pipecat` pulls in a whole
framework we need none of. onnxruntime itself is imported here, on first use, so `import omni_rt` stays
light. Sessions run on one thread each: every connection runs its own stream through the shared session
(onnxruntime's `run` is thread-safe), and a speech model must not take the cores the engine needs.
"""

from __future__ import annotations

import functools
import importlib.metadata
from pathlib import Path
from typing import Any

from omni_rt.errors import ConfigError

__all__ = ["onnx_session", "packaged_file"]

INSTALL_HINT = "install the `vad` extra: pip install 'omni_rt[vad]' (scripts/setup.sh does)"


def packaged_file(distribution: str, relpath: str) -> Path:
    """The installed file `relpath` of the distribution `distribution`; a `ConfigError` if it is absent."""
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(f"the package {distribution!r} is not installed: {INSTALL_HINT}") from None
    path = Path(str(dist.locate_file(relpath)))
    if not path.is_file():
        raise ConfigError(f"{distribution} {dist.version} has no {relpath}: {INSTALL_HINT}")
    return path


@functools.lru_cache(maxsize=8)
def onnx_session(path: Path) -> Any:
    """An onnxruntime CPU session of the model at `path`, cached for the process."""
    try:
        import onnxruntime as ort
    except ImportError:
        raise ConfigError(f"onnxruntime is not installed: {INSTALL_HINT}") from None
    opts = ort.SessionOptions()
    opts.inter_op_num_threads = 1
    opts.intra_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])
