"""What the loss features share: argument checks, batch-invariant torch primitives, the
vocab-parallel statistics combine, launch helpers and ``@triton.jit`` tile helpers.

Nothing here imports a feature package: imports run op -> kernels / torch path -> reference ->
``_common``.
"""
