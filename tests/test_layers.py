"""The package's layers (docs/how-it-works.md, "The layer map"): imports run one way, downward.

Read from the source with ast (no TensorFlow, nothing imported): every `import` and `from ...
import` of a bnrewrite module, at module level or inside a function, is an edge. Each module
imports only from its own layer and the layers below it, the modules' imports form no cycle,
and no module is over 500 lines.
"""

import ast
import functools
import pathlib

import networkx as nx

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "bnrewrite"
#: Bottom to top: a module's layer is its folder, else (a file at the root) its name. The package
#: itself (`__init__`) sits with `errors`: it imports nothing else until a public name is used.
LAYERS = (("errors", "__init__"), ("graph",), ("match",), ("rewrite",), ("session",), ("io",), ("cli",),
          ("entry", "__main__"))
MAX_LINES = 500


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(path: pathlib.Path, known: dict[str, pathlib.Path]) -> set[str]:
    """The bnrewrite modules `path` imports: `from a import b` is module a.b when that is one, else a."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "bnrewrite")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "bnrewrite":
            assert not node.level, f"{path}: relative import"
            found.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                         for a in node.names)
    return found


def layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else "__init__"
    return next(i for i, names in enumerate(LAYERS) if top in names)


@functools.lru_cache(maxsize=1)
def graph() -> nx.DiGraph:
    known = modules()
    g = nx.DiGraph()
    for name, path in known.items():
        g.add_node(name)
        g.add_edges_from((name, target) for target in imports(path, known))
    return g


def test_every_module_has_a_layer():
    tops = {name.split(".")[1] if "." in name else "__init__" for name in modules()}
    assert not tops - {top for names in LAYERS for top in names}, "folders or root files missing from LAYERS"


def test_imports_run_downward():
    upward = [f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)})" for a, b in graph().edges if layer(b) > layer(a)]
    assert not upward, "\n".join(upward)


def test_no_import_cycles():
    g = graph()
    assert nx.is_directed_acyclic_graph(g), " -> ".join(f"{a}" for a, _ in nx.find_cycle(g))


def test_the_package_imports_only_errors_eagerly():
    assert sorted(graph().successors("bnrewrite")) == ["bnrewrite.errors"]


def test_no_module_over_500_lines():
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_each_folder_says_what_it_may_import():
    for init in PACKAGE.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "May import" in doc, f"{init.parent.name}/__init__.py: no 'May import' in its docstring"
