"""Inputs shared by the delta codec tests."""
import torch

# fp8 travels as its bytes: float8_e4m3fn and uint8 are both covered.
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.float8_e4m3fn,
          torch.int64]
DENSITIES = [0.0, 1e-4, 1e-2, 0.5, 1.0]


def element_size(dtype):
    return torch.empty(0, dtype=dtype).element_size()


def random_pair(n, density, dtype, seed=0):
    """(new, old): random bit patterns; a ``density`` fraction of elements get random
    nonzero XOR flips (so exactly those elements change)."""
    g = torch.Generator().manual_seed(seed)
    size = element_size(dtype)
    old = torch.randint(0, 256, (n * size,), generator=g, dtype=torch.uint8)
    new = old.clone().view(n, size)
    mask = torch.rand(n, generator=g) < density
    flips = torch.randint(0, 256, (int(mask.sum()), size), generator=g, dtype=torch.uint8)
    flips[:, 0] |= 1                                   # never a zero flip
    new[mask] ^= flips
    return new.reshape(-1).view(dtype), old.view(dtype)


def ulp_step_pair(n, density, seed=0):
    """bf16 weights where a ``density`` fraction moved by one unit in the last place."""
    g = torch.Generator().manual_seed(seed)
    old = (torch.randn(n, generator=g) * 0.02).bfloat16()
    new = old.clone()
    idx = torch.randperm(n, generator=g)[:int(n * density)]
    step = torch.randint(0, 2, (idx.numel(),), generator=g, dtype=torch.int16) * 2 - 1
    new.view(torch.int16)[idx] += step
    return new, old


def bits(t):
    """Byte copy of a tensor, to compare before/after."""
    return t.detach().contiguous().view(torch.uint8).clone()


def changed_count(new, old):
    size = new.element_size()
    return int((new.contiguous().view(torch.uint8).view(-1, size)
                != old.contiguous().view(torch.uint8).view(-1, size)).any(1).sum())
