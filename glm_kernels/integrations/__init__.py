"""Thin adapters for training/inference frameworks. Import the submodule you need:

* ``glm_kernels.integrations.slime``  -- loss / TIS / OPD-advantage plug-ins for slime's
  ``--custom-*-path`` flags.
* ``glm_kernels.integrations.slime_delta`` -- ``install`` for ``--custom-megatron-init-path``:
  slime's ``--update-weight-mode delta`` diffs on the GPU (only changed bytes leave it).
* ``glm_kernels.integrations.sglang`` -- an SGLang custom weight loader that applies delta
  packets in place on the engine's parameters.

Importing this package imports neither slime, Megatron nor SGLang.
"""
