"""The package's import graph, read from the source with ``ast`` (nothing is imported).

docs/design.md section 1: no import cycle; a private name (``_x``, module or attribute) is used
only inside the package that defines it; inside a feature the rooms import one way (public
module -> ``_kernels`` / ``_torch`` -> ``_reference`` -> ``loss/_common``), never back.
"""
import pathlib
from typing import Dict, List, Set, Tuple

import pytest

from tests._import_graph import imported

ROOT = pathlib.Path(__file__).resolve().parent.parent / "glm_kernels"


def _modules() -> Dict[str, Tuple[pathlib.Path, bool]]:
    """dotted name -> (file, is_package)."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        out[".".join(parts)] = (path, is_pkg)
    return out


MODULES = _modules()


def _imports(name: str) -> List[Tuple[str, int]]:
    """(dotted path of each imported thing, line) for module ``name``: ``from X import n``
    gives ``X.n``, ``import X`` gives ``X``; relative imports resolved; any depth (lazy imports
    inside functions count)."""
    path, is_pkg = MODULES[name]
    package = name if is_pkg else name.rpartition(".")[0]
    return [(dotted, line) for dotted, line in imported(path, package)
            if dotted.split(".")[0] == "glm_kernels"]


def _is_extension(dotted: str) -> bool:
    """A compiled module (``glm_kernels._host``): no Python source, no imports of its own."""
    if dotted == "glm_kernels._host":      # built by setup.py; absent from an unbuilt tree
        return True
    parent, _, leaf = dotted.rpartition(".")
    if parent not in MODULES or not MODULES[parent][1]:
        return False
    return any(MODULES[parent][0].parent.glob(f"{leaf}.*.so")) or any(
        MODULES[parent][0].parent.glob(f"{leaf}.*.pyd"))


def _target_module(dotted: str) -> str:
    """The module an imported path lands in: itself if it is a module (or a compiled
    extension), else its parent."""
    return dotted if dotted in MODULES or _is_extension(dotted) else dotted.rpartition(".")[0]


def _graph() -> Dict[str, Set[str]]:
    return {name: {_target_module(d) for d, _ in _imports(name)} - {name} for name in MODULES}


def _is_private(component: str) -> bool:
    return component.startswith("_") and not component.startswith("__")


def _owner(dotted: str):
    """The package that owns the first private component of ``dotted`` (None: all public)."""
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        if _is_private(part):
            prefix = ".".join(parts[:i])
            if prefix in MODULES and not MODULES[prefix][1]:      # a module's private name
                prefix = prefix.rpartition(".")[0]
            return prefix
    return None


def test_the_graph_sees_the_package():
    graph = _graph()
    assert "glm_kernels.loss.icepop.icepop" in graph
    assert "glm_kernels.loss.icepop._reference" in graph["glm_kernels.loss.icepop._torch"]
    assert _owner("glm_kernels.loss.icepop.icepop._check_inputs") == "glm_kernels.loss.icepop"
    assert _owner("glm_kernels.loss._common.launch.run_op") == "glm_kernels.loss"
    assert _owner("glm_kernels.loss.policy_loss") is None


def test_no_import_cycle():
    graph = _graph()
    state: Dict[str, int] = {}                # 1: on the current path, 2: done
    cycles = []

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_no_private_name_crosses_its_package():
    crossings = []
    for name in sorted(MODULES):
        for dotted, line in _imports(name):
            owner = _owner(dotted)
            if owner is not None and not (name == owner or name.startswith(owner + ".")):
                crossings.append(f"{MODULES[name][0].relative_to(ROOT.parent)}:{line} "
                                 f"imports {dotted} (private to {owner})")
    assert not crossings, "\n".join(crossings)


ROOM_RANK = {"_reference": 1, "_torch": 2, "_kernels": 2}


def _room(name: str):
    """(feature package, rank) of a loss module: 0 for ``loss/_common``, the ``ROOM_RANK`` of
    a room, 3 for a public module, None for other private helpers and non-loss modules."""
    parts = name.split(".")
    if parts[:2] != ["glm_kernels", "loss"] or len(parts) < 4:
        return None, None
    if parts[2] == "_common":
        return "_common", 0
    if len(parts) != 4:
        return None, None
    leaf = parts[3]
    if leaf in ROOM_RANK or leaf.endswith("_kernels"):
        return parts[2], ROOM_RANK.get(leaf, 2)
    return parts[2], (None if _is_private(leaf) else 3)


@pytest.mark.parametrize("feature", sorted({n.split(".")[2] for n in MODULES
                                            if n.startswith("glm_kernels.loss.")
                                            and n.count(".") >= 3}))
def test_rooms_import_one_way(feature):
    """Within a feature: ``_reference`` imports no kernel, torch-path or public module of its
    own feature, ``_kernels`` / ``_torch`` no public module; ``_common`` imports no feature."""
    back = []
    for name, targets in _graph().items():
        src_feature, src_rank = _room(name)
        if src_feature != feature or src_rank is None:
            continue
        for target in targets:
            dst_feature, dst_rank = _room(target)
            if dst_rank is None:
                continue
            if feature == "_common" and dst_feature != "_common":
                back.append(f"{name} -> {target}")
            elif dst_feature == feature and src_rank < 3 and dst_rank > src_rank:
                back.append(f"{name} -> {target}")
    assert not back, "imports against the room order:\n" + "\n".join(back)
