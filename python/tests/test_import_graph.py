"""The package's modules import one another without a loop, function-level
imports included (those under ``if TYPE_CHECKING`` are for annotations and
never run)."""

import ast
import pathlib

import veloxquant

PACKAGE = pathlib.Path(veloxquant.__file__).parent


def _modules():
    mods = {}
    for f in PACKAGE.rglob("*.py"):
        parts = ("veloxquant",) + f.relative_to(PACKAGE).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return mods


def _imports(name, path, mods):
    tree = ast.parse(path.read_text())
    annotations_only = {
        id(x) for n in ast.walk(tree) if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)
        for x in ast.walk(n)
    }
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for n in ast.walk(tree):
        if id(n) in annotations_only:
            continue
        if isinstance(n, ast.ImportFrom):
            base = ".".join(package[: len(package) - n.level + 1] + ([n.module] if n.module else [])) if n.level else n.module
            found |= {t for t in [base] + [f"{base}.{a.name}" for a in n.names] if t in mods}
        elif isinstance(n, ast.Import):
            found |= {a.name for a in n.names if a.name in mods}
    # Every module imports its package first; that edge is no loop of theirs.
    return found - {name, "veloxquant"}


def _cycles(edges):
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on.discard(comp[-1])
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_itself_through_others():
    mods = _modules()
    edges = {m: _imports(m, f, mods) for m, f in mods.items()}
    assert "veloxquant.batch_cache" in edges["veloxquant.cache"]
    assert _cycles(edges) == []


def test_the_loop_finder_finds_a_loop():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
