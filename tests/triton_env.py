"""Triton for the kernel tests: whether it can run here (compiled on a GPU, or in its interpreter on the
CPU: conftest.py sets TRITON_INTERPRET=1 before anything imports Triton), and the skip marker.

    from triton_env import HAVE_TRITON, needs_triton
"""

import os

import pytest
import torch

try:
    import triton  # noqa: F401

    HAVE_TRITON = os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()
except ImportError:  # pragma: no cover - depends on the machine
    HAVE_TRITON = False

needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="Triton not installed (pip install triton)")
