"""The policy model (``TinyLM``) and its batch-invariant forward."""
