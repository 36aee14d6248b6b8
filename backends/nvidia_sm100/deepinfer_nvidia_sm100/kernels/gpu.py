"""Properties of the GPU the kernels launch on, read once per device."""

from __future__ import annotations

from functools import cache

import torch


@cache
def sm_count(index: int) -> int:
    """Streaming multiprocessors of CUDA device ``index`` (132 on an H100 / H200): kernels size their grids and
    K / key splits to fill them."""
    return torch.cuda.get_device_properties(index).multi_processor_count
