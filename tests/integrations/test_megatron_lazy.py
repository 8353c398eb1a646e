"""glm_kernels.integrations.megatron without megatron-core (the main venv): the module imports
(Megatron is imported lazily) and register() names what to install."""
import importlib.util
import sys

import pytest

from glm_kernels.integrations import megatron as plug


def test_module_imports_without_megatron_and_register_names_the_pip_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "megatron.core.optimizer", None)   # as if absent
    with pytest.raises(ImportError, match="pip install 'megatron-core==0.19.2'"):
        plug.register()


@pytest.mark.skipif(importlib.util.find_spec("emerging_optimizers") is not None,
                    reason="emerging-optimizers is installed")
def test_coefficient_types_need_emerging_optimizers_except_simple():
    assert plug.coefficient_schedule("simple", 5) == "jordan"
    with pytest.raises(ImportError, match="emerging-optimizers"):
        plug.coefficient_schedule("quintic", 5)
