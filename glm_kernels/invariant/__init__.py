"""Whole-model batch invariance (``glm_kernels.batch_invariant()`` enters it): an aten-level
override so a transformers model's rows get the same bits whatever their batch, padding,
thread count, or whether they are decoded with a KV cache. docs/batch_invariance.md."""
from .._dispatch import batch_invariant_enabled
from .mode import COVERED, UNCOVERED_REDUCTIONS, BatchInvariantMode, mode_active, whole_model

__all__ = ["BatchInvariantMode", "COVERED", "UNCOVERED_REDUCTIONS", "mode_active", "whole_model"]

# GLM_KERNELS_BATCH_INVARIANT=1: the override is on for the thread that imports glm_kernels
# (other threads enter it with ``with glm_kernels.batch_invariant():``). It reads the switch
# per op, so ``batch_invariant(False)`` still turns it off inside a block.
if batch_invariant_enabled() and not mode_active():
    BatchInvariantMode().__enter__()
