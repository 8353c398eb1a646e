"""The examples in the delta codec's docstrings and in docs/delta.md run and say what they show."""
import doctest
import os
import re

import glm_kernels
from glm_kernels.delta import codec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_docstring_examples():
    with glm_kernels.force_backend("torch"):
        result = doctest.testmod(codec, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted >= 8 and result.failed == 0


def test_docs_page_example():
    with open(os.path.join(ROOT, "docs", "delta.md")) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    assert blocks
    namespace = {}                      # the page's blocks run in order, like one session
    with glm_kernels.force_backend("torch"):
        for block in blocks:
            exec(compile(block, "docs/delta.md", "exec"), namespace)
