"""Host ids onto the device without a host sync: what the stage runners feed every step, and what the
Talker's prompt builder gathers its positions with."""

from __future__ import annotations

import torch

__all__ = ["to_device"]


def to_device(data, device: torch.device) -> torch.Tensor:
    """Host ids (nested lists of ints, or a CPU tensor) on `device` without a host sync.

    `torch.tensor(ids, device="cuda")` is a blocking copy, and PyTorch implements a blocking host-to-
    device copy as an async copy plus a synchronize of the whole current stream: each one made the
    stage's thread wait for every kernel it had queued (after a prefill launch, the whole prefill)
    before it could launch anything else. Staged in pinned memory, the copy is queued like a kernel;
    the caching host allocator keeps the pinned block until the copy has run."""
    t = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=torch.long)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
