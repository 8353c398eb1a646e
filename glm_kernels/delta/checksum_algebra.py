"""The result checksum's algebra, for integrations that maintain a checksum incrementally.

A packet's checksum is a finalised 64-bit sum of one term per (position, word) of the tensor's
bit pattern (``_reference.py`` defines it). Because it is a sum, a writer that changes a few
elements can update it without reading the whole tensor: ``unfinalize`` a known checksum,
subtract the old elements' ``element_terms`` and add the new ones (mod 2^64), ``finalize``
again. slime's GPU delta sync (``glm_kernels.integrations.slime.delta``) does this.
"""
from ._reference import (MASK64, NP_UINT, element_terms, finalize, int_view, unfinalize,
                         words_per_element)

__all__ = ["MASK64", "NP_UINT", "element_terms", "finalize", "int_view", "unfinalize",
           "words_per_element"]
