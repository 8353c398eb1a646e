"""Compile every registered Triton kernel configuration for sm_90 with no GPU and report it.

For each ``AotSpec`` in ``glm_kernels/**/*_kernels.py:AOT_SPECS``: registers per thread,
spilled bytes (local memory), static shared memory, whether the SASS issues HGMMA
(Hopper's warpgroup MMA), and how many global loads/stores are 128-bit (vectorized).
Pointer arguments carry Triton's 16-byte divisibility hint, as they do at runtime for the
aligned buffers torch allocates, so the report shows the variant a launch compiles. A
configuration with integer arguments is compiled a second time as ``name +ints%16``, every
integer argument also hinted divisible by 16: the variant Triton's JIT specializes for when
sizes and strides are multiples of 16 (vocab 151552, 2048-token tiles, ...), usually the one
whose loads vectorize. With ``--check`` the script exits non-zero on any spill (in either
variant), on a block whose registers exceed the SM's register file (it could not launch), on
a matrix kernel without HGMMA, or on a configuration that fails to compile.

Disassembling a cubin costs ~0.5 s of CPU whatever its size (cuobjdump's start-up), more than
compiling it: ``--check`` disassembles only the matrix kernels, whose HGMMA it checks, and
leaves the load/store widths of the others out (``-``); ``--sass`` disassembles every one.

    python benchmarks/aot_report.py [--check] [--json out.json] [--only NAME_SUBSTRING]
                                    [--jobs N] [--sass]

Configurations compile in ``--jobs`` processes (default: the CPU count, at most 4); the
report lists them in the same order whatever the count.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import importlib
import json
import multiprocessing
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
import time

os.environ.pop("TRITON_INTERPRET", None)          # compile for real, never interpret
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import glm_kernels  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
# sm_90's register file: 65536 32-bit registers per SM (and per block); a warp's registers are
# allocated in units of 256 (8 a thread). A block that needs more cannot launch at all
# ("too many resources requested for launch"), which no compile step reports.
REGISTER_FILE = 65536
REGISTER_ALLOCATION_UNIT = 256
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                         "cuobjdump")


def discover_specs():
    """AOT_SPECS of every ``*_kernels.py`` module under ``glm_kernels/`` (features and the
    feature subpackages of ``loss/``), in a stable order."""
    specs = []
    for module_info in sorted(pkgutil.walk_packages(glm_kernels.__path__, "glm_kernels."),
                              key=lambda m: m.name):
        if not module_info.ispkg and module_info.name.rsplit(".", 1)[1].endswith("_kernels"):
            module = importlib.import_module(module_info.name)
            specs.extend(getattr(module, "AOT_SPECS", []))
    return specs


_INT_TYPES = ("i32", "i64")


def divisibility_attrs(spec, ints: bool = False) -> dict:
    """``ASTSource`` attrs marking every pointer argument 16-byte aligned (and, with
    ``ints``, every integer argument divisible by 16).

    At launch, Triton's JIT specializes a pointer whose address is a multiple of 16 and an
    integer divisible by 16 with ``tt.divisibility = 16``, which lets it emit 64/128-bit
    loads; without the hint an AOT compile reports the scalar-load variant instead. Keys are
    argument paths: ``(index in the kernel's argument list,)``.
    """
    names = spec.kernel.arg_names
    return {(names.index(arg),): [["tt.divisibility", 16]]
            for arg, ty in spec.signature.items()
            if ty.startswith("*") or (ints and ty in _INT_TYPES)}


_ACCESS_BITS = {"128": 128, "64": 64, "U16": 16, "S16": 16, "U8": 8, "S8": 8}


def _memory_widths(sass: str, opcode: str) -> dict:
    """Count of ``opcode`` (LDG/STG) instructions by access width in bits. 128 is a vector
    access for any element type; 64 is one for 4-byte or narrower elements but a plain
    access for 8-byte ones, so the table counts 128-bit accesses and the JSON keeps all."""
    widths: dict = {}
    for mods in re.findall(rf"\b{opcode}((?:\.\w+)*)", sass):
        found = re.search(r"\.(128|64|U16|S16|U8|S8)\b", mods)
        bits = _ACCESS_BITS[found.group(1)] if found else 32
        widths[bits] = widths.get(bits, 0) + 1
    return widths


def _resource_usage(cubin: bytes, disassemble: bool = True) -> dict:
    """Registers, local and stack bytes of a cubin; with ``disassemble``, also its HGMMA count
    and global load/store widths (None without)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([CUOBJDUMP, "--dump-resource-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([CUOBJDUMP, "--dump-sass", f.name], capture_output=True,
                              text=True, check=True).stdout if disassemble else None
    fields = dict(re.findall(r"(\w+):(\d+)", usage.split("Function", 1)[-1]))
    row = {"registers": int(fields.get("REG", -1)), "local_bytes": int(fields.get("LOCAL", 0)),
           "stack_bytes": int(fields.get("STACK", 0)),
           "hgmma": None, "ldg_bits": None, "stg_bits": None, "sass_lines": None}
    if sass is not None:
        row.update(hgmma=len(re.findall(r"\bHGMMA\b", sass)),
                   ldg_bits=_memory_widths(sass, "LDG"), stg_bits=_memory_widths(sass, "STG"),
                   sass_lines=sass.count("\n"))
    return row


def block_registers(registers: int, num_warps: int) -> int:
    """Registers one block of ``num_warps`` warps takes from the SM's register file."""
    per_warp = -(-registers * 32 // REGISTER_ALLOCATION_UNIT) * REGISTER_ALLOCATION_UNIT
    return per_warp * num_warps


def compile_spec(spec, ints: bool = False, disassemble: bool = True) -> dict:
    start = time.time()
    source = ASTSource(spec.kernel, spec.signature, spec.constexprs,
                       divisibility_attrs(spec, ints))
    options = {"num_warps": spec.num_warps, "num_stages": spec.num_stages}
    if spec.maxnreg is not None:
        options["maxnreg"] = spec.maxnreg
    kernel = triton.compile(source, target=TARGET, options=options)
    row = {"name": spec.name + (" +ints%16" if ints else ""), "num_warps": spec.num_warps,
           "num_stages": spec.num_stages,
           "shared_bytes": int(kernel.metadata.shared), "expects_hgmma": spec.expects_hgmma}
    row.update(_resource_usage(kernel.asm["cubin"], disassemble or spec.expects_hgmma))
    row["compile_s"] = round(time.time() - start, 2)
    problems = []
    if row["local_bytes"] or row["stack_bytes"]:
        problems.append(f"spills {row['local_bytes']} B local / {row['stack_bytes']} B stack")
    if block_registers(row["registers"], spec.num_warps) > REGISTER_FILE:
        problems.append(f"{row['registers']} registers x {spec.num_warps * 32} threads exceed "
                        f"the {REGISTER_FILE}-register file: the launch fails")
    if spec.expects_hgmma and not row["hgmma"]:
        problems.append("matrix kernel issues no HGMMA")
    row["problems"] = problems
    return row


_SPECS: list = []          # this process's specs, in discovery order (see _load_specs)


def _load_specs(only) -> list:
    """The specs to report (and, in a worker process, the ones it compiles by index: spawned
    workers discover them again rather than pickling @triton.jit functions)."""
    _SPECS[:] = [s for s in discover_specs() if not only or only in s.name]
    return _SPECS


def _compile_variant(variant) -> dict:
    """compile_spec of (index into _SPECS, ints, disassemble); a config that does not compile
    is a failure row, not a skip."""
    index, ints, disassemble = variant
    spec = _SPECS[index]
    try:
        return compile_spec(spec, ints, disassemble)
    except Exception as exc:
        return {"name": spec.name + (" +ints%16" if ints else ""), "compile_failed": True,
                "problems": [f"compile failed: {type(exc).__name__}: "
                             f"{str(exc).splitlines()[0][:200]}"]}


def _compile_all(variants, jobs: int, only):
    if jobs <= 1:
        return map(_compile_variant, variants)
    # spawn, not fork: a forked copy of a process that has imported torch and triton can hang.
    pool = concurrent.futures.ProcessPoolExecutor(
        jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_load_specs,
        initargs=(only,))
    with pool:
        return list(pool.map(_compile_variant, variants))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="fail on spills, register-file overflow, missing HGMMA")
    parser.add_argument("--sass", action="store_true",
                        help="with --check, still disassemble every kernel (load/store widths)")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--only", help="compile only specs whose name contains this")
    parser.add_argument("--jobs", type=int, default=min(os.cpu_count() or 1, 4),
                        help="compile in this many processes (default: CPUs, at most 4)")
    args = parser.parse_args(argv)

    specs = _load_specs(args.only)
    rows, failures = [], []
    header = f"{'kernel configuration':72s} {'warps':>5s} {'regs':>5s} {'spill':>6s} " \
             f"{'smem':>7s} {'HGMMA':>6s} {'LDG.128':>8s} {'STG.128':>8s}"
    print(f"sm_90 ahead-of-time report, triton {triton.__version__}, {len(specs)} configurations "
          f"(+ the ints%16 variant of those with integer arguments)")
    disassemble = args.sass or not args.check
    if not disassemble:
        print("--check: only the matrix kernels are disassembled (HGMMA); load/store widths "
              "of the others are '-' (--sass for all)")
    print(header)
    print("-" * len(header))
    variants = [(i, False, disassemble) for i in range(len(specs))] + [
        (i, True, disassemble) for i, spec in enumerate(specs)
        if any(t in _INT_TYPES for t in spec.signature.values())]
    for row in _compile_all(variants, args.jobs, args.only):
        if row.get("compile_failed"):
            print(f"{row['name']:72s} COMPILE FAILED: {row['problems'][0]}")
        else:
            hgmma = str(row["hgmma"]) if row["expects_hgmma"] or row["hgmma"] else "-"
            ldg, stg = (f"{row[k].get(128, 0)}/{sum(row[k].values())}" if row[k] is not None
                        else "-" for k in ("ldg_bits", "stg_bits"))
            print(f"{row['name']:72s} {row['num_warps']:5d} {row['registers']:5d} "
                  f"{row['local_bytes']:6d} {row['shared_bytes']:7d} {hgmma:>6s} "
                  f"{ldg:>8s} {stg:>8s}"
                  + (f"   <- {'; '.join(row['problems'])}" if row["problems"] else ""))
        rows.append(row)
        if row["problems"]:
            failures.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"target": "sm_90", "triton": triton.__version__, "rows": rows}, f, indent=1)
    if failures:
        print(f"{len(failures)} configuration(s) with problems")
    return 1 if (args.check and failures) else 0


if __name__ == "__main__":
    sys.exit(main())
