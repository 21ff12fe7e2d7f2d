"""The package's import graph: no cycles, and every import points down the layers ARCHITECTURE.md draws.

Imports are read from the source with ``ast`` — module level and inside functions alike, so a lazy
import cannot hide a cycle — except those under ``if TYPE_CHECKING:``, which never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[2] / "src" / "multihead"

# The layers of ARCHITECTURE.md, top to bottom. A module may import modules of its own layer or of
# layers below it, never above. Longest prefix wins.
LAYERS = [
    ("multihead.cli", "the command line"),
    ("multihead.lab.bench", "reports: what the commands print and write"),
    ("multihead.cost_report", "reports: what the commands print and write"),
    ("multihead.lab.inspect.terminal", "reports: what the commands print and write"),
    ("multihead.lab.inspect.html", "reports: what the commands print and write"),
    ("multihead.lab.inspect.plots", "reports: what the commands print and write"),
    ("multihead.lab.inspect.headreport", "reports: what the commands print and write"),
    ("multihead.lab.inspect.write", "reports: what the commands print and write"),
    ("multihead.lab.inspect.long_report", "reports: what the commands print and write"),
    ("multihead.lab.inspect.browse_report", "reports: what the commands print and write"),
    ("multihead.lab.circuits.report", "reports: what the commands print and write"),
    ("multihead.lab.inspect.page", "reports: what the commands print and write"),
    ("multihead.lab.inspect", "models and their inspection"),
    ("multihead.lab.models", "models and their inspection"),
    ("multihead.integrations", "models and their inspection"),
    ("multihead.lab.train", "models and their inspection"),
    ("multihead.lab.circuits", "models and their inspection"),
    ("multihead.lab", "models and their inspection"),
    ("multihead.parallel", "across processes"),
    ("multihead.parallel.split", "counting and measuring"),  # the sharding rules the cost model applies too
    ("multihead.cost", "counting and measuring"),
    ("multihead.machine", "counting and measuring"),
    ("multihead.backend_rates", "counting and measuring"),
    ("multihead.compat", "the layer"),
    ("multihead.layer", "the layer"),
    ("multihead.latent", "the layer"),
    ("multihead.attend", "the layer"),
    ("multihead.capture", "the layer"),
    ("multihead.heads", "the layer"),
    ("multihead.cache", "the layer"),
    ("multihead.paged", "the layer"),
    ("multihead.positional", "the layer"),
    ("multihead.functional", "the kernel"),
    ("multihead.streamed_stats", "the kernel"),
    ("multihead.varlen", "the kernel"),
    ("multihead.backends", "the backends"),
    ("multihead.masks", "typed masks"),
    ("multihead._", "shared helpers"),
    ("multihead.lab._", "shared helpers"),  # the lab's own: HTML templates, PNG, word lists
]
ORDER = list(dict.fromkeys(layer for _, layer in LAYERS))


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE_ROOT.rglob("*.py"))}


def _type_checking_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def _run_time_nodes(node: ast.AST):
    """Every node under ``node`` except the bodies of ``if TYPE_CHECKING:`` blocks."""
    for child in ast.iter_child_nodes(node):
        if _type_checking_block(child):
            for other in child.orelse:  # an else branch does run
                yield other
                yield from _run_time_nodes(other)
            continue
        yield child
        yield from _run_time_nodes(child)


def _resolve(name: str) -> str | None:
    """The package module ``name`` refers to (a module, or the module defining the imported attribute)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str) -> set[str]:
    """The multihead modules ``module`` imports at run time (implicit parent-package imports left out)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in _run_time_nodes(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{alias.name}" for alias in node.names]
        for name in names:
            target = _resolve(name)
            if target is not None and target != module:
                found.add(target)
    return found


GRAPH = {module: imports_of(module) for module in MODULES}


# `import multihead` loads the core only (the lab loads on first use, see multihead/__init__.py): the package's
# root sits in the layer's rank, the top of the core, with no exemption from the layer rule
ROOT_LAYER = "the layer"


def layer_of(module: str) -> str:
    if module == "multihead":
        return ROOT_LAYER
    prefix = max((p for p, _ in LAYERS if module.startswith(p)), key=len)
    return dict(LAYERS)[prefix]


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (cycle := visit(target)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_the_graph_is_read_from_real_imports():
    # guards the reader itself: known edges are found, and an edge under TYPE_CHECKING is not
    assert "multihead.functional" in GRAPH["multihead.layer"]
    assert "multihead.layer" in GRAPH["multihead.compat"]
    assert "multihead.layer" not in GRAPH["multihead.heads"]  # heads names the layer for annotations only
    assert len(GRAPH) > 30


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_in_the_package():
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_every_module_has_a_layer():
    assert {module: layer_of(module) for module in MODULES}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down_the_layers(module):
    rank = ORDER.index(layer_of(module))
    facade = MODULES[module].name == "__init__.py" and module != "multihead"  # a subpackage re-exports its modules
    upward = sorted(
        target
        for target in GRAPH[module]
        if not (facade and target.startswith(module + ".")) and ORDER.index(layer_of(target)) < rank
    )
    assert not upward, f"{module} ({layer_of(module)}) imports {upward} from a layer above it"


def test_the_layers_run_in_the_documented_order():
    # cli -> reports -> models/inspect -> cost -> layer -> functional -> backends -> masks -> helpers
    chain = [
        "multihead.cli",
        "multihead.lab.inspect.write",
        "multihead.lab.inspect.inspection",
        "multihead.cost",
        "multihead.layer",
        "multihead.functional",
        "multihead.backends.tiled",
        "multihead.masks",
        "multihead._errors",
    ]
    ranks = [ORDER.index(layer_of(module)) for module in chain]
    assert ranks == sorted(set(ranks)), dict(zip(chain, ranks, strict=True))


def _package_of(module: str) -> str:
    """The package a module belongs to: itself for a package's __init__, else its parent."""
    return module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]


def test_a_private_module_is_imported_only_inside_its_own_package():
    # backends/_blocks, masks/_documents, ...: what a package keeps private stays behind its public modules
    leaks = sorted(
        f"{module} imports {target}"
        for module, targets in GRAPH.items()
        for target in targets
        if target.rpartition(".")[2].startswith("_") and not (module + ".").startswith(target.rpartition(".")[0] + ".")
    )
    assert not leaks, leaks


def test_masks_import_nothing_above_them():
    above = sorted(
        f"{module} imports {target}"
        for module, targets in GRAPH.items()
        if module.startswith("multihead.masks")
        for target in targets
        if not (target.startswith("multihead.masks") or target.startswith("multihead._"))
    )
    assert not above, above


def package_graph() -> dict[str, set[str]]:
    """Which packages' modules import which other packages' modules (a module at the root is its own node)."""

    def node(module: str) -> str:
        parts = module.split(".")
        depth = 3 if parts[1:2] == ["lab"] else 2  # the lab's packages are nodes of their own, as the core's
        return ".".join(parts[:depth]) if len(parts) > 1 else module

    graph: dict[str, set[str]] = {node(module): set() for module in MODULES}
    for module, targets in GRAPH.items():
        graph[node(module)] |= {node(target) for target in targets if node(target) != node(module)}
    return graph


def test_no_cycle_between_packages():
    cycle = find_cycle(package_graph())
    assert cycle is None, "import cycle between packages: " + " -> ".join(cycle or [])


def test_no_cycle_even_through_annotations():
    # an import under TYPE_CHECKING still ties two files together for a reader: no cycle counts them either
    graph = {module: set(imports_of(module)) | annotation_imports(module) for module in MODULES}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle (annotations included): " + " -> ".join(cycle or [])


def annotation_imports(module: str) -> set[str]:
    """The multihead modules ``module`` imports under ``if TYPE_CHECKING:``."""
    path = MODULES[module]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if _type_checking_block(node):
            for child in node.body:
                if isinstance(child, ast.ImportFrom) and child.module and not child.level:
                    for alias in child.names:
                        target = _resolve(f"{child.module}.{alias.name}")
                        if target is not None and target != module:
                            found.add(target)
    return found


MAX_FUNCTION_LINES = 100  # a function reads in one screen: past this, its parts get names of their own


def test_no_function_in_the_package_is_over_100_lines():
    long = sorted(
        f"{module}.{node.name} ({node.end_lineno - node.lineno + 1} lines, line {node.lineno})"
        for module, path in MODULES.items()
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    )
    assert not long, long


# The wings: the core is every module but the lab and what sits beside it (the command line, the integrations)
BESIDE_THE_CORE = ("multihead.lab", "multihead.cli", "multihead.integrations")


def in_core(module: str) -> bool:
    return not any(module == wing or module.startswith(wing + ".") for wing in BESIDE_THE_CORE)


def test_nothing_in_the_core_imports_the_lab():
    # the one rule of the split: `pip install multihead` (torch alone) runs every core module; the root package
    # reaches the lab only on first use of `multihead.lab` (importlib, by name)
    crossing = sorted(
        f"{module} imports {target}"
        for module, targets in GRAPH.items()
        if in_core(module)
        for target in targets
        if not in_core(target)
    )
    assert not crossing, crossing


def test_the_package_root_holds_the_core_and_one_lab_folder():
    entries = {path.name for path in PACKAGE_ROOT.iterdir() if not path.name.startswith((".", "__pycache__"))}
    lab_only = {
        "inspect",
        "models",
        "circuits",
        "train",
        "bench.py",
        "bench_report.py",
        "data",
        "_html.py",
        "_words.py",
    }
    assert "lab" in entries and not entries & lab_only, sorted(entries & lab_only)
