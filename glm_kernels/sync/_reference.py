"""FP8 block quantization, the definition (plain torch; the CPU path and the test oracle).

DeepSeek-V3's / SGLang's FP8 weight recipe: a 2-D weight ``w`` [R, C] is cut into blocks of
``block = (br, bc)`` (128 x 128); per block, in fp32::

    amax      = max(|w|) over the block, at least 1e-4   (DeepGEMM's per_block_cast_to_fp8)
    q         = float8_e4m3fn(w * (448 / amax))          (round to nearest even; |.| <= 448)
    scale_inv = amax / 448                               ([ceil(R / br), ceil(C / bc)], fp32)

so that ``w ≈ q * scale_inv`` (block-broadcast), the ``weight_scale_inv`` SGLang loads beside
each FP8 ``weight``. Blocks at the right and bottom edges are partial (no padding is stored).
"""
import torch

FP8_MAX = 448.0
AMAX_FLOOR = 1e-4
# The divisor of scale_inv as a tensor: Inductor (torch < 2.13) turns a division by a
# constant into a multiplication by its reciprocal, one ulp off amax / 448 for some amax.
_FP8_MAX_TENSOR = torch.tensor(FP8_MAX)


def quantize_fp8_blocks(w: torch.Tensor, block=(128, 128)):
    """(q float8_e4m3fn [R, C], scale_inv float32 [ceil(R/br), ceil(C/bc)]) of ``w``."""
    br, bc = block
    rows, cols = w.shape
    nr, nc = -(-rows // br), -(-cols // bc)
    x = torch.zeros(nr * br, nc * bc, dtype=torch.float32, device=w.device)
    x[:rows, :cols] = w.float()
    blocks = x.view(nr, br, nc, bc)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=AMAX_FLOOR)
    scale = torch.full_like(amax, FP8_MAX) / amax
    q = (blocks * scale[:, None, :, None]).to(torch.float8_e4m3fn)
    q = q.view(nr * br, nc * bc)[:rows, :cols].contiguous()
    return q, amax / _FP8_MAX_TENSOR.to(amax.device)
