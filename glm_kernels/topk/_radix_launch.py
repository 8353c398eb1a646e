"""Launch parameters of the radix top-k kernels per Triton release (warps, register cap,
wide tile). Plain Python, no Triton import: the host-side config heuristic
(``topk.make_topk_config``) and the kernel module (``_radix_kernels``) both read it."""
from __future__ import annotations

from .._dispatch import triton_version

# Launch parameters per Triton release (ptxas's register choice follows Triton's codegen;
# benchmarks/aot_report.py --check guards every configuration on the oldest and the newest
# Triton that CI tests):
# * Triton >= 3.7: two 8-warp programs per SM, 65536 / 512 threads = 128 registers. Left to
#   itself ptxas settles on 128 with a 32-48 B stack of spilled loop invariants for the tiled
#   8-warp launch; told the cap, it fits in 127 with none. The 16-warp and direct launches
#   compile without spills uncapped and spill 16 B when capped, so they keep ptxas's choice.
# * Triton 3.6 keeps more values live: the tiled launches need 196-232 registers (sm_90 AOT),
#   so they run uncapped at 8 warps, one program per SM (16 warps would cap them at 128 and
#   spill 80 B; a 128 cap at 8 warps spills 40 B); its direct launch spills 40 B at ptxas's own
#   choice (128) and none when capped at 168. 168 registers fit 8 warps, not 16 (16 x 32 x
#   168 = 86016 > the 65536-register file: such a launch fails), so it runs at most 8 warps.
# * Triton 3.4 as 3.6 (tiled: 196-227 registers uncapped at 8 warps; direct: 166-168 capped
#   at 168), with 2048-entry tiles: a 4096 tile needs more than 255 registers there
#   (radix_wide_tile; on 3.6 the direct launch's 4096 tile spills at 168, so it too).
RADIX_MAXNREG_8_WARPS = 128
_TRITON_3_6_DIRECT_MAXNREG = 168


def radix_launch(num_warps: int, direct: bool):
    """(num_warps, maxnreg) a radix launch asked for ``num_warps`` runs with here."""
    if triton_version() < (3, 7):
        return min(num_warps, 8), (_TRITON_3_6_DIRECT_MAXNREG if direct else None)
    return num_warps, (RADIX_MAXNREG_8_WARPS if num_warps == 8 and not direct else None)


def radix_wide_tile(direct: bool) -> int:
    """The radix tile of a launch with fewer rows than SMs: 4096, or 2048 where that code
    spills at the at most 8 warps Triton < 3.7 runs (:func:`radix_launch`; sm_90
    AOT): the tiled kernel on Triton < 3.6 (> 255 registers, 8-32 B of stack on 3.4) and the
    direct one on < 3.7 (168-register cap, 24-64 B of stack on 3.6)."""
    version = triton_version()
    return 4096 if version >= (3, 7) or (version >= (3, 6) and not direct) else 2048
