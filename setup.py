"""Build glm_kernels; compiles the C++17 host extension from csrc/ when it can.

The extension (``glm_kernels._host``) is optional: the delta codec's CPU paths fall back to
numpy without it (logged once at run time). A build without a C++17 compiler or without
pybind11 prints one line saying what is lost and installs the pure-Python package, in a
``py3-none-any`` wheel (nothing in it is tied to one CPython or platform).
CUDA sources (csrc/*.cu) are not compiled by this build.
"""
import glob
import sys

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel as _setuptools_bdist_wheel
from setuptools.command.build_ext import build_ext as _setuptools_build_ext

# Measured by benchmarks/bench_delta.py's cpu_goal (bf16, 1 % one-ulp steps, 2 threads).
_LOST = ("the C++ host codec (glm_kernels._host) was not built{why}; the delta codec's CPU "
         "paths use numpy instead (20-60x slower). Install a C++17 compiler and "
         "pybind11, then reinstall: pip install --no-build-isolation .")
_skipped = []     # why the extension was not built, if it was not


def _skip(why: str) -> None:
    _skipped.append(why)
    notice = "glm_kernels: " + _LOST.format(why=f" ({why})")
    print(notice, file=sys.stderr)
    # pip shows a successful build's output only with -v; the terminal it runs in is the one
    # place a plain `pip install` user still sees the notice (no terminal, e.g. CI: stderr only).
    try:
        with open("/dev/tty", "w") as tty:
            tty.write(notice + "\n")
    except OSError:
        pass


class OptionalBuildExt(_setuptools_build_ext):
    """Build the extension if the toolchain allows; never fail the install because of it."""

    def run(self):
        try:
            super().run()
        except Exception as exc:  # no compiler at all (distutils raises before compiling)
            _skip(f"{type(exc).__name__}: {exc}")

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # CompileError / LinkError / a compiler without C++17
            first_line = (str(exc).splitlines() or [""])[0]
            _skip(f"{type(exc).__name__}: {first_line[:120]}")


def _extensions():
    cpp_sources = sorted(glob.glob("csrc/*.cpp"))
    if glob.glob("csrc/*.cu"):
        print("glm_kernels: csrc/*.cu found but this build compiles host code only; "
              "CUDA sources skipped", file=sys.stderr)
    if not cpp_sources:
        return []
    try:
        from pybind11.setup_helpers import Pybind11Extension
    except ImportError:
        _skip("pybind11 is not installed in the build environment")
        return []
    extra = ["-O3"]
    libraries = []
    if sys.platform.startswith("linux"):
        extra.append("-pthread")
        libraries.append("pthread")
    return [Pybind11Extension("glm_kernels._host", cpp_sources, cxx_std=17,
                              extra_compile_args=extra, libraries=libraries)]


class WheelTaggedByContent(_setuptools_bdist_wheel):
    """A wheel whose extension was not built is pure Python: tag it py3-none-any, not with
    the building CPython's ABI and platform (setuptools decides that before building)."""

    def run(self):
        if not self.skip_build:
            self.run_command("build")    # runs once; the base class's run does not repeat it
        if _skipped:
            self.root_is_pure = True
            # else install_lib still targets platlib (the wheel's .data/platlib/)
            self.distribution.ext_modules = []
        super().run()


setup(ext_modules=_extensions(),
      cmdclass={"build_ext": OptionalBuildExt, "bdist_wheel": WheelTaggedByContent})
