"""What a Python source file imports, read with ``ast`` (nothing is imported): the layout
tests of the package and of the example build their import graphs from it."""
import ast
import pathlib
from typing import List, Tuple


def imported(path: pathlib.Path, package: str) -> List[Tuple[str, int]]:
    """(dotted path of each imported thing, line) in ``path``, a module of ``package``:
    ``from X import n`` gives ``X.n``, ``import X`` gives ``X``; relative imports resolved;
    any depth (lazy imports inside functions count)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            found.extend((f"{source}.{alias.name}", node.lineno) for alias in node.names)
        elif isinstance(node, ast.Import):
            found.extend((alias.name, node.lineno) for alias in node.names)
    return found
