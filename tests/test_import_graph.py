"""The package's modules import one another without circles, counting imports inside functions and under
`if TYPE_CHECKING:` too (an import moved into a function body or read only by annotations still ties the two
modules together). Every import inside a function says why it is there (start-up time) in a comment."""

import ast
import io
import tokenize
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mtptrain"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imported(tree: ast.AST, here: str, is_package: bool) -> set[str]:
    """Names of the modules a module's code imports, in function bodies and type-checking blocks too."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package this module is in
                package = here.split(".") if is_package else here.split(".")[:-1]
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import submodule`
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports, with the packages whose __init__ an import runs (those that
    do not contain the importing module: a module inside a package is run by that package, not the reverse)."""
    known = modules()
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        edges = set()
        for target in _imported(ast.parse(path.read_text()), name, path.name == "__init__.py"):
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                prefix = ".".join(parts[:i])
                if prefix in known and prefix != name and not (name + ".").startswith(prefix + "."):
                    edges.add(prefix)
        graph[name] = edges
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def test_the_package_has_no_import_circle():
    found = circles(import_graph())
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_check_finds_a_circle_hidden_in_a_function_body_or_a_type_checking_block():
    graph = {"a": {"b"}, "b": {"c"}, "c": set()}
    assert circles(graph) == []
    source = "def late():\n    from mtptrain.a import x\n"
    assert "mtptrain.a" in _imported(ast.parse(source), "mtptrain.c", False)
    graph["c"] = {"a"}
    assert circles(graph) == [["a", "b", "c"]]
    typing_only = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from mtptrain.a import x\n"
    assert "mtptrain.a" in _imported(ast.parse(typing_only), "mtptrain.c", False)


def test_the_graph_is_read_from_the_real_package():
    graph = import_graph()
    assert "mtptrain.export.run" in graph["mtptrain.cli"] or "mtptrain.export.run" in set().union(*graph.values())
    assert "mtptrain.heads.checkpoint" in graph["mtptrain.train.trainer"]


def documented_layers() -> dict[str, int]:
    """Path (a file, or a folder ending in /) inside mtptrain/ -> its layer, read from docs/architecture.md."""
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    block = text.split("## Layers", 1)[1].split("```", 2)[1]
    layers, layer = {}, None
    for line in block.splitlines():
        column = line[:43]
        if column[:1].isdigit():
            layer = int(column[0])
        for path in column[1:].replace(",", " ").split():
            if path.endswith((".py", "/")):
                layers[path] = layer
    return layers


def layer_of(module: str, layers: dict[str, int], graph: dict[str, set[str]]) -> int:
    path = module.replace(".", "/").removeprefix("mtptrain/")
    candidates = [p for p in layers if path + ".py" == p or (path + "/").startswith(p)]
    if not candidates and not graph[module]:  # a package whose __init__ imports nothing (a docstring)
        return 0
    assert candidates, f"{module} is in no layer of docs/architecture.md"
    return layers[max(candidates, key=len)]


def test_imports_go_down_the_layers_the_architecture_doc_shows():
    layers, graph = documented_layers(), import_graph()
    upward = [f"{a} (layer {layer_of(a, layers, graph)}) imports {b} (layer {layer_of(b, layers, graph)})"
              for a, targets in graph.items() for b in targets
              if b != "mtptrain" and layer_of(b, layers, graph) > layer_of(a, layers, graph)]
    assert not upward, "\n".join(upward)


def test_the_distribution_installs_one_top_level_package():
    """What `pip install .` installs: the packages setuptools resolves from pyproject.toml, all under mtptrain."""
    from setuptools.config.pyprojecttoml import read_configuration

    packages = read_configuration(PACKAGE.parent / "pyproject.toml")["tool"]["setuptools"]["packages"]
    assert {p.split(".")[0] for p in packages} == {"mtptrain"}, packages
    assert {"mtptrain.data", "mtptrain.eval", "mtptrain.export.formats", "mtptrain.engine.ssd"} <= set(packages)


# A module whose docstring states this covers its imports inside functions with that one rule.
MODULE_RULE = "every import inside a function in this module follows one rule"
MODULE_RULE_FILES = ("cli.py",)


def uncommented_function_imports(source: str) -> list[int]:
    """Lines of the imports inside function bodies that have no comment on their own line(s), on an earlier
    import of their run of consecutive imports, or on the comment line(s) directly above that run."""
    lines = source.splitlines()
    comments = {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                if tok.type == tokenize.COMMENT}
    tree = ast.parse(source)
    in_functions = {id(node) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                    for node in ast.walk(fn) if isinstance(node, (ast.Import, ast.ImportFrom))}
    missing = []
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(node, field, None)
            if not isinstance(block, list):
                continue
            covered = False  # by a comment above the current run of imports, or on an earlier one of it
            for i, stmt in enumerate(block):
                if id(stmt) not in in_functions:
                    continue
                if i == 0 or id(block[i - 1]) not in in_functions:  # a run starts: is a comment line right above?
                    above = stmt.lineno - 1
                    covered = above in comments and lines[above - 1].lstrip().startswith("#")
                covered = covered or any(n in comments for n in range(stmt.lineno, stmt.end_lineno + 1))
                if not covered:
                    missing.append(stmt.lineno)
    return sorted(missing)


def test_the_comment_check_reads_runs_of_imports():
    source = """import os


def f():
    \"\"\"Doc.\"\"\"
    # why these two
    import a
    from b import c

    import d
    import e  # why this one
    x = 1
    import g
    try:
        # why
        import h
    except ImportError:
        import i
    import j  # why j
    import k
"""
    assert uncommented_function_imports(source) == [13, 18]
    assert uncommented_function_imports("def f():  # not about the import\n    import a\n") == [2]
    assert uncommented_function_imports("# why\nimport a\n") == []  # not in a function: nothing to say


def test_every_import_inside_a_function_says_why():
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        if path.relative_to(PACKAGE).as_posix() in MODULE_RULE_FILES:
            docstring = " ".join((ast.get_docstring(ast.parse(source)) or "").split())
            assert MODULE_RULE in docstring.lower(), f"{path}: its docstring must state its rule for imports in functions"
            continue
        missing += [f"{path.relative_to(PACKAGE.parent)}:{line}" for line in uncommented_function_imports(source)]
    assert not missing, ("imports inside functions need a comment saying why they are not at the top (start-up "
                         "time, with a measured figure), or belong at the top:\n" + "\n".join(missing))
