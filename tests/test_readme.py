"""README.md's Python examples run as written (a newcomer pastes them first)."""
import os
import re

import pytest

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def _python_blocks():
    with open(README) as f:
        return re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)


def test_readme_has_python_examples():
    assert _python_blocks(), "README.md lost its Python examples"


@pytest.mark.parametrize("index", range(len(_python_blocks())))
def test_readme_example_runs(index, capsys):
    namespace = {"__name__": f"readme_example_{index}"}
    exec(compile(_python_blocks()[index], f"README.md[python block {index}]", "exec"), namespace)
    if "icepop_loss" in _python_blocks()[index]:
        loss, metrics = namespace["loss"], namespace["metrics"]
        assert loss.ndim == 0 and bool(loss.isfinite())
        assert namespace["policy"][1].weight.grad is not None          # the step trained
        assert "pop_frac" in capsys.readouterr().out
