"""Delta weight codec (docs/design.md 3.5): send only the elements whose bit pattern changed.

``encode(new, old)`` -> ``DeltaPacket``; ``apply_(target, packet)`` in place;
``verify(target, packet)`` runs apply_'s checks without writing;
``packet.to_bytes()`` / ``DeltaPacket.from_bytes(b)`` for the wire; ``checksum(t)`` is the
checksum packets carry; ``apply_safetensors_`` applies into a memory-mapped safetensors file.
"""
from ._device import DeltaKernelConfig
from .codec import apply_, apply_safetensors_, checksum, encode, verify
from .packet import ENCODINGS, SUPPORTED_DTYPES, DeltaPacket

__all__ = ["encode", "apply_", "verify", "checksum", "apply_safetensors_", "DeltaPacket",
           "ENCODINGS", "SUPPORTED_DTYPES", "DeltaKernelConfig"]
