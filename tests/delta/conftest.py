"""The codec paths every delta test module runs on, as one fixture."""
import pytest

import glm_kernels
from glm_kernels.delta import DeltaKernelConfig, _host_codec
from tests.conftest import DEVICE, KERNEL_BACKEND, skip_without_kernels

# Small tiles, so that the interpreter exercises several programs on small tensors.
SMALL = DeltaKernelConfig(block=1024, apply_block=1024)


@pytest.fixture(params=["cpp", "numpy", "kernels"])
def path(request, monkeypatch):
    """(name, device) of the codec path under test: the C++ host codec, its numpy fallback,
    or the Triton kernels (interpreter on CPU, compiled on a GPU)."""
    if request.param == "kernels":
        skip_without_kernels()
        backend, device = KERNEL_BACKEND, DEVICE
    else:
        if request.param == "cpp" and _host_codec._ext is None:
            pytest.skip("C++ host extension not built")
        if request.param == "numpy":
            monkeypatch.setattr(_host_codec, "_ext", None)
        backend, device = "torch", "cpu"
    with glm_kernels.force_backend(backend):
        yield request.param, device


def path_kwargs(path) -> dict:
    """The keyword arguments an encode/apply_/verify call takes on ``path``."""
    return dict(config=SMALL) if path[0] == "kernels" else {}
