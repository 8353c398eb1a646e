"""docs/batch_invariance.md's whole-model recipe runs as written and prints what it shows."""
import contextlib
import io
import os
import re

import pytest

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))), "docs", "batch_invariance.md")


def test_whole_model_recipe_prints_what_the_doc_shows():
    pytest.importorskip("transformers")
    text = open(DOC).read()
    section = text[text.index("### Recipe"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    shown = re.search(r"```text\n(.*?)```", section, re.S).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "docs/batch_invariance.md[recipe]", "exec"), {})
    assert out.getvalue() == shown
