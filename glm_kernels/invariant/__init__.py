"""Whole-model batch invariance (``glm_kernels.batch_invariant()`` enters it): an aten-level
override so a transformers model's rows get the same bits whatever their batch, padding,
thread count, or whether they are decoded with a KV cache. docs/batch_invariance.md."""
from .._checks import check_bool
from .._dispatch import batch_invariant_enabled, batch_invariant_switch
from .mode import (COVERED, UNCOVERED_REDUCTIONS, BatchInvariantMode, hold_for_process,
                   mode_active, whole_model)

__all__ = ["batch_invariant", "BatchInvariantMode", "COVERED", "UNCOVERED_REDUCTIONS", "mode_active",
           "whole_model"]


def batch_invariant(enabled: bool = True):
    """Inside the block (this thread), the log-prob, loss and metric ops give every row of a
    batch a result bitwise independent of the other rows, their order and the chunking; so do
    the aten ops a whole model runs (``glm_kernels.invariant``: padding and KV cache too).

    Off by default: the default plans may tile by batch size for speed. ``enabled=False``
    turns it off inside a block where ``GLM_KERNELS_BATCH_INVARIANT=1`` turned it on.
    docs/batch_invariance.md lists the ops it covers and what it costs.
    """
    check_bool("enabled", enabled)
    return whole_model(batch_invariant_switch(enabled), enabled)


# GLM_KERNELS_BATCH_INVARIANT=1: the override is registered for the whole process and answers
# in every thread (the variable turns each thread's switch on); it reads the switch per op, so
# ``batch_invariant(False)`` still turns it off inside a block.
if batch_invariant_enabled():
    hold_for_process()
