"""Modules that register torch.library custom ops keep real annotations.

torch 2.4 (the declared floor) reads a custom op's schema from its annotations and rejects the
strings that ``from __future__ import annotations`` leaves there: the package then fails to
import on the floor (CI's test-min caught it twice). Checked on the source text, so that every
torch version's run sees it, not only the floor's.
"""
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "glm_kernels"


def test_no_postponed_annotations_where_custom_ops_are_registered():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        if "custom_op(" in text and "from __future__ import annotations" in text:
            offenders.append(str(path.relative_to(PACKAGE.parent)))
    assert offenders == [], f"custom ops registered under postponed annotations: {offenders}"


def test_the_check_sees_custom_op_modules():
    # The scan above must find the modules it guards (a moved package would make it vacuous).
    registering = [p for p in PACKAGE.rglob("*.py") if "custom_op(" in p.read_text()]
    assert len(registering) >= 5
