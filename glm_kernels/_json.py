"""Bounded JSON parsing of untrusted headers (safetensors files, packets): size and nesting are
checked before ``json.loads`` runs."""
import re


# A backslash and the character it escapes, then a whole string (no escapes left inside):
# both patterns are linear (no alternative can match the same text two ways).
_JSON_ESCAPE = re.compile(rb"\\.", re.S)


_JSON_STRING = re.compile(rb'"[^"]*"')


def json_nesting_depth(data: bytes) -> int:
    """The deepest ``[``/``{`` nesting of JSON text, brackets inside strings not counted.

    Linear in ``len(data)`` and not recursive, so it can vet untrusted text before
    ``json.loads``, whose parser recurses once per level (100,000 ``[`` raise RecursionError)."""
    import numpy as np
    skeleton = _JSON_ESCAPE.sub(b"", data) if b"\\" in data else data
    if b'"' in skeleton:
        skeleton = _JSON_STRING.sub(b"", skeleton)
    chars = np.frombuffer(skeleton, dtype=np.uint8)
    steps = (((chars == ord("[")) | (chars == ord("{"))).astype(np.int32)
             - ((chars == ord("]")) | (chars == ord("}"))))
    return int(np.cumsum(steps, dtype=np.int64).max()) if steps.size else 0


def json_loads_bounded(data, what: str, *, max_bytes: int, max_depth: int = 32,
                       error: type = ValueError):
    """``json.loads(data)`` for untrusted bytes or str: size and nesting are bounded *before* parsing
    and every failure is one ``error`` naming ``what`` (never a RecursionError)."""
    import json
    data = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    if len(data) > max_bytes:
        raise error(f"{what}: {len(data)} bytes of JSON, more than the {max_bytes} allowed")
    depth = json_nesting_depth(data)
    if depth > max_depth:
        raise error(f"{what}: JSON nested {depth} levels deep, more than the {max_depth} "
                    f"allowed (refused before parsing)")
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:   # RecursionError: unreachable after the bound
        raise error(f"{what}: malformed JSON ({exc})") from None
