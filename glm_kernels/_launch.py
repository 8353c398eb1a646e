"""Launch helpers shared by every feature: the device's SM count (cached per device)."""
from typing import Optional

import torch

_SM_COUNTS: dict = {}           # device index -> multiprocessors


def sm_count(index: Optional[int]) -> int:
    """Streaming multiprocessors of CUDA device ``index`` (None: the current device), queried
    once per device."""
    if index is None:
        index = torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]
