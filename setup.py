"""Build glm_kernels; compiles the C++17 host extension from csrc/ when it can.

The extension (``glm_kernels._host``) is optional: the delta codec's CPU paths fall back to
numpy without it (logged once at run time). A build without a C++17 compiler or without
pybind11 prints one line saying what is lost and installs the pure-Python package.
CUDA sources (csrc/*.cu) are not compiled by this build.
"""
import glob
import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext as _setuptools_build_ext

_LOST = ("the C++ host codec (glm_kernels._host) was not built{why}; the delta codec's CPU "
         "paths use numpy instead (several times slower). Install a C++17 compiler and "
         "pybind11, then reinstall: pip install --no-build-isolation .")


def _skip(why: str) -> None:
    print("glm_kernels: " + _LOST.format(why=f" ({why})"), file=sys.stderr)


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


setup(ext_modules=_extensions(), cmdclass={"build_ext": OptionalBuildExt})
