"""Launch plumbing of the from-logits ops (log-probs, IcePop from logits, reverse KL, nucleus):
the launch configuration, the custom ops' autograd wiring (eager and traced), shape checks of
[*S, V] logits and the out-of-range token-id flag the kernels set on the device."""
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch

from ... import _checks, _dispatch
from ..._launch import sm_count


@dataclass(frozen=True)
class LogitsLaunchConfig:
    """Launch parameters shared by the from-logits kernels.

    block_v, num_warps: vocab tile and warps of the streaming kernels (4096 bf16 = 8 KB/tile).
    max_single_tile: the fused IcePop kernel holds rows of up to this many columns in one
        register tile and reads them once (fp32/bf16/fp16 logits).
    onchip_tile: bf16/fp16 rows of up to 3 * onchip_tile columns are held in three register
        tiles (32 warps): a TP=8 shard of GLM-5's 154880 vocab (19360) is read once. These are
        the largest on-chip rows that compile without spills for sm_90 (AOT report).
    programs_per_sm: rows in flight per SM in the fused kernel's persistent grid for longer
        rows, which are swept twice; few rows in flight let the second sweep hit L2.
    max_programs: explicit grid cap of the fused kernel (overrides programs_per_sm).
    """
    block_v: int = 4096
    num_warps: int = 8
    max_single_tile: int = 16384
    onchip_tile: int = 8192
    programs_per_sm: int = 2
    max_programs: Optional[int] = None

    def row_plan(self, v: int, element_size: int) -> Tuple[int, int, int]:
        """(row_tiles, BLOCK_V, num_warps) of the fused kernel; row_tiles 0 = streamed.

        Mismatch metrics do not change the plan: every plan's METRICS variant compiles for
        sm_90 without spills (``aot_report.py --check``), so they never cost a read of the row.
        """
        if element_size <= 4 and v <= self.max_single_tile:
            block = 1 << max(v - 1, 1).bit_length()
            return 1, block, 4 if block <= 1024 else 8 if block <= 4096 else 16
        if element_size <= 2 and v <= 3 * self.onchip_tile:
            return 3, self.onchip_tile, 32
        return 0, self.block_v, self.num_warps

    def fused_programs(self, device: torch.device) -> int:
        if self.max_programs is not None:
            return self.max_programs
        if device.type != "cuda":
            return 1 << 30
        return sm_count(device.index) * self.programs_per_sm


# Small tiles for the interpreter (every plan is exercised at test sizes: one tile up to 256
# columns, three tiles up to 384 in bf16, streamed beyond) and 3 programs, so that each
# program of the persistent loop handles several rows.
_INTERPRET_CONFIG = LogitsLaunchConfig(block_v=256, num_warps=4, max_single_tile=256,
                                       onchip_tile=128, max_programs=3)


def make_launch_config(backend: str) -> LogitsLaunchConfig:
    """The heuristic default for ``backend`` (``triton`` or ``interpret``)."""
    return _INTERPRET_CONFIG if backend == "interpret" else LogitsLaunchConfig()


def differentiable_op(op, impl: Callable, setup_context: Callable, backward: Callable):
    """A public differentiable op in the house style (docs/design.md 1, "Autograd").

    ``backward`` is registered on the custom op ``op`` (body ``impl``) with ``setup_context``;
    the function returned calls ``op`` while torch.compile traces, and in eager mode ``impl``
    directly, under a small ``autograd.Function`` running the same ``setup_context`` and
    ``backward`` when a tensor argument needs a gradient: that skips the dispatcher and
    torch.library's autograd wrapper, ~0.1 ms a call forward and as much backward on the CPU
    (argument normalisation, pytree, the generated node). Inside ``backward``, :func:`call_op`
    picks the kernels' entry point.
    """
    torch.library.register_autograd(op, backward, setup_context=setup_context)

    def forward(ctx, *args):
        ctx.eager = True
        output = impl(*args)
        setup_context(ctx, args, output)
        return output

    name = impl.__name__.strip("_")
    name = name[:-len("_impl")] if name.endswith("_impl") else name
    node = type(f"{name}_eager", (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(backward)})

    def call(*args):
        if torch.compiler.is_compiling():
            return op(*args)
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad
                                           for a in args):
            return node.apply(*args)
        return impl(*args)

    return call


def in_eager_node(ctx) -> bool:
    """Whether a backward runs under :func:`differentiable_op`'s eager node; else under the
    op's registered autograd, whose backward may be traced (then only ops may enter it, not
    their bodies). ``torch.compiler.is_compiling()`` cannot tell: torch 2.4 leaves it False
    while AOTAutograd traces a backward."""
    return getattr(ctx, "eager", False)


def call_op(ctx, op, impl: Callable, *args):
    """A backward's kernel call: the custom op ``op``, or its body ``impl`` under the eager
    node (:func:`in_eager_node`)."""
    return impl(*args) if in_eager_node(ctx) else op(*args)


def check_logits_and_ids(logits, token_ids, logits_name="logits") -> int:
    """Validate [*S, V] logits against [*S] int32/int64 ids; returns V."""
    _checks.check_tensor(logits_name, logits, floating=True)
    _checks.check_tensor("token_ids", token_ids, dtypes=(torch.int32, torch.int64))
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"{logits_name} must be [*S, V] with V >= 1, got shape "
                         f"{tuple(logits.shape)}")
    if token_ids.shape != logits.shape[:-1]:
        raise ValueError(f"token_ids must have shape {logits_name}.shape[:-1] = "
                         f"{tuple(logits.shape[:-1])}, got {tuple(token_ids.shape)}")
    _checks.check_same_device({logits_name: logits, "token_ids": token_ids})
    return logits.shape[-1]


def rows_2d(x: torch.Tensor) -> torch.Tensor:
    """[*S, V] -> contiguous [N, V] (a view when ``x`` is contiguous)."""
    return x.reshape(-1, x.shape[-1]).contiguous()


def token_id_flag(token_ids: torch.Tensor, vocab_total: int) -> torch.Tensor:
    """A zeroed int32 [1] flag that kernels set when an id lies outside [0, vocab_total).

    On CPU the ids are checked here, before anything runs (no device to wait for): a clear
    ValueError. On CUDA a host-side check would cost a device sync per call; the kernel flags
    the id instead and :func:`check_token_id_flag` turns the flag into an asynchronous
    device-side assert (like torch's own index checks in gather / nll_loss).
    """
    if not token_ids.is_cuda and token_ids.numel():
        lo, hi = int(token_ids.min()), int(token_ids.max())
        if lo < 0 or hi >= vocab_total:
            raise ValueError(f"token_ids must lie in [0, {vocab_total}), got range [{lo}, {hi}]")
    return torch.zeros(1, dtype=torch.int32, device=token_ids.device)


def check_token_id_flag(flag: torch.Tensor, vocab_total: int) -> None:
    if flag.is_cuda:
        torch._assert_async(flag[0] == 0, f"glm_kernels: token_ids outside [0, {vocab_total})")


def flag_ids_torch(flag, token_ids, vocab_total) -> None:
    """The torch backend's version of the kernels' id flag (device tensors only)."""
    if token_ids.is_cuda:
        flag |= ((token_ids < 0) | (token_ids >= vocab_total)).any().to(torch.int32)



def prepare_call(op: str, logits: torch.Tensor, token_ids: torch.Tensor, vocab_total: int,
                 kernels_or_none: Callable[[str], Optional[object]]):
    """(kernel module or None for torch, launch config or None, token-id flag) of one call;
    ``kernels_or_none(backend)`` is the calling feature's kernel module for that backend.

    The flag is checked now on CPU (ValueError) and set on the device by the torch path or,
    later, by the kernels; :func:`check_token_id_flag` reads it after the launch.
    """
    flag = token_id_flag(token_ids, vocab_total)
    backend = _dispatch.select_backend(op, logits)
    kernels = kernels_or_none(backend)
    if kernels is None:
        flag_ids_torch(flag, token_ids, vocab_total)
        return None, None, flag
    return kernels, make_launch_config(backend), flag
