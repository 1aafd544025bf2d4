"""Imports flow one way: no cycle between the package's folders or between its files, counting imports inside
functions too (a lazy import hides a dependency, it does not remove it)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "disagmoe_ds"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    """File -> the package's files it imports (``from pkg import name`` counts the submodule when there is one)."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("disagmoe_ds"):
                subs = {f"{node.module}.{alias.name}" for alias in node.names} & files.keys()
                deps |= subs or {node.module}
            elif isinstance(node, ast.Import):
                deps |= {alias.name for alias in node.names if alias.name.startswith("disagmoe_ds")}
        graph[name] = {d for d in deps if d in files and d != name}
    return graph


def _folder(module: str) -> str:
    """``disagmoe_ds.afpipe.build`` -> ``afpipe``; a top-level file is its own folder (``layout``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` if it has any (iterative DFS with colours)."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    for root in sorted(graph):
        if state.get(root):
            continue
        stack = [(root, iter(sorted(graph[root])))]
        state[root], path = 1, [root]
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                state[node] = 2
                stack.pop()
                path.pop()
            elif state.get(child) == 1:
                return [*path[path.index(child) :], child]
            elif not state.get(child):
                state[child] = 1
                path.append(child)
                stack.append((child, iter(sorted(graph.get(child, ())))))
    return None


def test_no_cycle_between_folders() -> None:
    graph = _graph()
    folders: dict[str, set[str]] = {}
    for module, deps in graph.items():
        folders.setdefault(_folder(module), set()).update(_folder(d) for d in deps if _folder(d) != _folder(module))
    assert _cycle(folders) is None, " -> ".join(_cycle(folders))


# The module map of docs/architecture.md, top first: a folder imports only folders below it, and the two modes
# (``afpipe``, ``colocated``) are peers over the shared runtime, neither importing the other.
LAYERS = (
    "convert", "train", "afpipe", "colocated", "checkpoint", "parity", "runtime", "groups", "config", "planner",
    "models", "capabilities", "comm", "fp8", "schedule", "layout", "launch", "data", "plot", "jsonfile", "errors",
    "disagmoe_ds",
)  # fmt: skip


def test_folders_import_only_folders_below_them() -> None:
    graph = _graph()
    assert {_folder(m) for m in graph} == set(LAYERS), "a folder is missing from LAYERS (and from the module map)"
    upward = sorted(
        f"{module} -> {dep}"
        for module, deps in graph.items()
        for dep in deps
        if LAYERS.index(_folder(dep)) < LAYERS.index(_folder(module))
    )
    assert not upward, upward
    assert not [
        m for m, deps in graph.items() if _folder(m) == "afpipe" and any(_folder(d) == "colocated" for d in deps)
    ]


def test_no_cycle_between_files() -> None:
    graph = _graph()
    # a package's __init__ re-exports its files, which import siblings through the package: not a cycle of files
    files = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in graph.items()}
    assert _cycle(files) is None, " -> ".join(_cycle(files))


def test_the_checker_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
