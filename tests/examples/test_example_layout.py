"""The example's layout by role, read from the source with ``ast`` (nothing is imported).

``examples/async_trainer`` is folders by role (``env/``, ``model/``, ``rollout/``, ``train/``)
under the entry point and the modules every role shares; an import between roles goes down
``LAYERS`` only, so no role reaches back into the one that drives it, and no module import
cycle exists (docs/trainer.md, "How the example is built")."""
import pathlib
from typing import Dict, Set

from tests._import_graph import imported

ROOT = pathlib.Path(__file__).resolve().parents[2] / "examples" / "async_trainer"
PREFIX = "examples.async_trainer"
# Top to bottom; a role imports only roles below its own (or itself).
LAYERS = [["__main__"], ["trainer"], ["train"], ["rollout"], ["model"], ["config", "plot"],
          ["env", "kernels"], ["log"]]
RANK = {role: i for i, layer in enumerate(LAYERS) for role in layer}


def _modules() -> Dict[str, pathlib.Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str) -> Set[str]:
    """The example's modules that module ``name`` imports (any depth, lazy imports too)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for target, _ in imported(path, package):
        while target.startswith(PREFIX) and target not in MODULES:
            target = target.rpartition(".")[0]
        if target.startswith(PREFIX) and target != name:
            found.add(target)
    return found


def _role(name: str) -> str:
    rest = name[len(PREFIX) + 1:]
    return rest.split(".")[0] if rest else ""


def test_every_module_has_a_role():
    roles = {_role(m) for m in MODULES} - {""}
    assert roles == set(RANK), roles ^ set(RANK)
    for folder in ("env", "model", "rollout", "train"):
        assert (ROOT / folder / "__init__.py").is_file(), folder
    assert len(MODULES) > 30, sorted(MODULES)                  # the walk sees the example


def test_roles_import_downwards_only():
    upward = [f"{m} -> {t}" for m in MODULES if _role(m) for t in _imports(m)
              if _role(t) and _role(t) != _role(m) and RANK[_role(t)] <= RANK[_role(m)]]
    assert upward == []


def test_no_import_cycle():
    graph = {m: _imports(m) for m in MODULES}
    state: Dict[str, int] = {}

    def visit(m, path):
        state[m] = 1
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                raise AssertionError(" -> ".join(path + [m, t]))
            if t not in state:
                visit(t, path + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
