"""The package's layers import only downward (docs/design.md, "Layers"), and no two modules
import each other, at module level or late inside a function.

Read from the source with `ast`: every import statement counts, wherever it is."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "sbpflow"

# lowest first. A module may import its own package or any lower layer; packages that share a
# layer are peers and do not import each other (nn and optim meet through gradsync, below both).
LAYERS = [
    {"errors", "utils", "random_regions", "caches"},
    {"sbp", "placement"},
    {"layouts"},  # Layout: a placement and an nd-sbp on it (needs both peers below)
    {"comm"},
    {"boxing"},
    {"cost"},
    {"ops"},
    {"tensor"},
    {"param_state"},   # a parameter's framework state, one record (gradsync, zero, nn, optim)
    {"gradsync"},
    {"memory"},   # what each rank holds: reads tensors and boxing only
    {"zero"},     # ZeRO's layouts, units, gathers: the optimizer's step and graph mode use it
    {"nn", "optim"},
    {"runtime"},  # generic actors and registers (data loading and cyclic DP use them too)
    {"graph"},    # lowers a traced step to runtime plans
    {"data"},
    {"parallel", "models"},
    {"auto"},
    {"demo", "bench"},
    {"cli"},
    {"__main__"},
]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}
RANK["__package__"] = len(LAYERS)  # `import sbpflow`: the face that re-exports everything


def _modules() -> dict[tuple, pathlib.Path]:
    return {p.relative_to(PACKAGE).with_suffix("").parts: p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(parts: tuple, path: pathlib.Path) -> list[tuple[int, tuple]]:
    """(line, imported module path inside the package) for each import in a module: relative
    and absolute imports, ``from sbpflow import x``, and ``importlib.import_module("sbpflow.x")``
    / ``__import__`` with a constant name. ``import sbpflow`` itself is ``("__package__",)``: the
    package face, above every layer."""
    pkg = list(parts[:-1])
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[:len(pkg) - node.level + 1] if node.level > 1 else pkg
                if node.module:
                    out.append((node.lineno, tuple(base + node.module.split("."))))
                else:
                    out += [(node.lineno, tuple(base + [a.name])) for a in node.names]
            elif node.module == "sbpflow":
                out += [(node.lineno, (a.name,)) for a in node.names]
            elif node.module and node.module.split(".")[0] == "sbpflow":
                out.append((node.lineno, tuple(node.module.split(".")[1:])))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, _absolute(a.name)) for a in node.names
                    if a.name.split(".")[0] == "sbpflow"]
        elif isinstance(node, ast.Call) and _dynamic_import(node):
            out.append((node.lineno, _absolute(node.args[0].value)))
    return [(line, t) for line, t in out if t]


def _absolute(name: str) -> tuple:
    rest = tuple(name.split(".")[1:])
    return rest or ("__package__",)


def _dynamic_import(call: ast.Call) -> bool:
    """``importlib.import_module("sbpflow...")`` or ``__import__("sbpflow...")``."""
    f = call.func
    named = (isinstance(f, ast.Attribute) and f.attr == "import_module") or \
        (isinstance(f, ast.Name) and f.id in ("__import__", "import_module"))
    return named and bool(call.args) and isinstance(call.args[0], ast.Constant) and \
        isinstance(call.args[0].value, str) and call.args[0].value.split(".")[0] == "sbpflow"


def test_every_top_level_name_has_a_layer():
    names = {parts[0] for parts in _modules() if parts[0] != "__init__"}
    assert names <= set(RANK), f"give these a layer in tests/test_layers.py: {names - set(RANK)}"


def test_layers_import_only_downward():
    bad = []
    for parts, path in _modules().items():
        if parts == ("__init__",):
            continue  # the package face re-exports everything
        own = RANK[parts[0]]
        for line, target in _imports(parts, path):
            if target[0] == parts[0]:
                continue
            if RANK.get(target[0], -1) >= own:
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports "
                           f"sbpflow.{'.'.join(target)}")
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def _resolve(target: tuple, mods: dict) -> tuple | None:
    """The module an import names (a name imported from a module resolves to the module)."""
    for cut in (len(target), len(target) - 1):
        if cut and target[:cut] in mods:
            return target[:cut]
    return None


def test_no_two_modules_import_each_other():
    """Cycles through package ``__init__`` files (which re-export) are not counted."""
    mods = _modules()
    graph = {}
    for parts, path in mods.items():
        if parts[-1] == "__init__":
            continue
        deps = {_resolve(t, mods) for _, t in _imports(parts, path)}
        graph[parts] = {d for d in deps if d is not None and d[-1] != "__init__" and d != parts}
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                cycles.append(" -> ".join(".".join(n) for n in stack[stack.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "modules that import each other:\n" + "\n".join(cycles)


@pytest.mark.parametrize("name", ["optim", "nn"])
def test_nn_and_optim_are_peers(name):
    other = {"optim": "nn", "nn": "optim"}[name]
    found = [f"{p}:{line}" for parts, p in _modules().items() if parts[0] == name
             for line, t in _imports(parts, p) if t[0] == other]
    assert not found, f"{name} imports {other}: {found}"


# inside sbpflow/tensor/, lowest first: the class (global_tensor) imports neither its dispatch
# nor its op methods, which import it; tensor/__init__.py wires them to it (`_bind_dispatch`,
# `_set_methods`), so each module keeps one job without an import cycle
TENSOR_ORDER = ["hooks", "resplits", "views", "dispatch_records", "global_tensor", "mixing",
                "dispatch", "methods", "creation"]


def test_tensor_modules_import_only_downward():
    mods = {parts[1]: path for parts, path in _modules().items()
            if parts[0] == "tensor" and len(parts) == 2 and parts[1] != "__init__"}
    assert set(mods) == set(TENSOR_ORDER), f"place in TENSOR_ORDER: {set(mods) ^ set(TENSOR_ORDER)}"
    rank = {name: i for i, name in enumerate(TENSOR_ORDER)}
    bad = [f"sbpflow/tensor/{name}.py:{line} imports sbpflow.tensor.{target[1]}"
           for name, path in mods.items() for line, target in _imports(("tensor", name), path)
           if target[0] == "tensor" and len(target) > 1 and rank.get(target[1], -1) >= rank[name]]
    assert not bad, "sbpflow/tensor/ imports against its order:\n" + "\n".join(bad)
