"""Train/rollout mismatch metrics under verl's key names and with verl's values
(``mismatch.py``)."""
from .mismatch import (MISMATCH_KEYS, mismatch_from_tokens, mismatch_metrics, raise_if_nonfinite,
                       train_side_nonfinite_count)

__all__ = ["MISMATCH_KEYS", "mismatch_metrics", "mismatch_from_tokens", "raise_if_nonfinite",
           "train_side_nonfinite_count"]
