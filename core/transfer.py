"""Host values to the device without waiting for it.

A blocking host-to-device copy (``tensor.to(device)``, ``torch.tensor(..., device=)``)
waits for every kernel already queued on the stream. Building a step while the device
runs the one before (async scheduling, or simply a deep queue) then stalls on each such
copy. Every per-step copy of host values goes through ``to_device`` instead: the source
is a fresh host array that nothing writes afterwards, and a non-blocking copy from
pageable memory stages it before returning, so the copy needs no pinned buffer.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(
    host: np.ndarray | torch.Tensor | Sequence[int] | Sequence[float],
    device: torch.device | str,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``host`` (a NumPy array, a CPU tensor or a list of numbers) as a tensor on
    ``device``, of ``dtype`` if given, copied without waiting for the device's queue.
    A CPU ``device`` gets the tensor itself (NumPy arrays and CPU tensors not copied)."""
    if isinstance(host, np.ndarray):
        tensor = torch.from_numpy(host)
    elif isinstance(host, torch.Tensor):
        tensor = host
    else:
        tensor = torch.tensor(host, dtype=dtype)
    if dtype is not None and tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    return tensor.to(device, non_blocking=True)
