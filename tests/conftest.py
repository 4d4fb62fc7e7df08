"""Shared test fixtures: cached reference models and saved checkpoints (see tests/hf_fixtures.py).

Reference models and checkpoints are built once per test session and shared between test files:
treat them as read-only (a test that needs to modify weights must copy them first).

    def test_x(reference, checkpoint):
        ref = reference("tiny")            # transformers Qwen3OmniMoeForConditionalGeneration, fp32, eval
        ckpt = checkpoint("deep")          # Path of a sharded safetensors checkpoint saved from it
        cfg = SMALL_CONFIGS["deep"]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# The kernel tests run Triton in its interpreter on the CPU; the variable must be set before Triton is
# first imported, so here, before any test module is collected (see tests/triton_env.py).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# `python -m pytest` puts the repo root on sys.path but plain `pytest` does not; the tests need it.
_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))


@pytest.fixture(scope="session")
def reference():
    """`reference(name, seed=0)`: the cached reference model for `SMALL_CONFIGS[name]`."""
    from hf_fixtures import SMALL_CONFIGS, make_reference

    cache: dict = {}

    def get(name: str = "tiny", seed: int = 0):
        key = (name, seed)
        if key not in cache:
            cache[key] = make_reference(SMALL_CONFIGS[name], seed)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def checkpoint(reference, tmp_path_factory):
    """`checkpoint(name, seed=0)`: Path of a sharded HF checkpoint saved from `reference(name, seed)`."""
    from hf_fixtures import save_checkpoint

    cache: dict = {}

    def get(name: str = "tiny", seed: int = 0) -> Path:
        key = (name, seed)
        if key not in cache:
            cache[key] = save_checkpoint(
                reference(name, seed), tmp_path_factory.mktemp(f"ckpt-{name}-{seed}")
            )
        return cache[key]

    return get
