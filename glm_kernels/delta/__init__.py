"""Delta weight codec (DESIGN 3.5): send only the elements whose bit pattern changed."""
from .packet import ENCODINGS, DeltaPacket, apply_, encode

__all__ = ["encode", "apply_", "DeltaPacket", "ENCODINGS"]
