"""Ahead-of-time compile specs: every kernel configuration the GPU path can launch.

Each feature's ``_kernels.py`` lists its configurations in ``AOT_SPECS`` so that
``benchmarks/aot_report.py`` can compile them for sm_90 with no GPU and report registers,
spills, shared memory and whether matrix kernels issue HGMMA (wgmma).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional


@dataclass(frozen=True)
class AotSpec:
    name: str                              # human label: "icepop_fwd_bwd[BLOCK=4096]"
    kernel: Callable                       # the @triton.jit function
    signature: Dict[str, str]              # arg name -> "*fp32", "i32", "fp32", "constexpr"
    constexprs: Dict[str, Any] = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 3
    expects_hgmma: bool = False            # a matmul kernel: missing wgmma fails the report
    maxnreg: Optional[int] = None          # register cap the launch passes (None: ptxas's)
