"""The engine's layout, read from its source with `ast`: no import cycles among its modules, layers that
import only downward, a docstring on every package saying its job, and modules short enough to read
in one sitting. Imports under `if TYPE_CHECKING:` and inside functions count: they are still edges."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ENGINE = Path(__file__).parents[2] / "kubeinfer" / "engine"
PACKAGE = "kubeinfer.engine"
# Top to bottom; a module may import its own layer or any layer below. The shared modules at the
# engine's top level (config, sampling_params, sequence, triton_utils) are the bottom layer; distributed (the
# tensor-parallel group and its collectives) sits just above it, under the layers that split a model. kv_transfer
# (external KV tiers) is driven by core and knows the block manager only through what core hands it.
# platforms (what differs by device) shares model_executor's layer: the layers call its kernels and its decoder
# fast path reads their modules; the folder-cycle test below bounds what may cross between them.
LAYERS = ("entrypoints", "core", "kv_transfer", "spec_decode", ("model_executor", "platforms"), "structured_output", "lora",
          "distributed", "")
_RANKS = {name: rank for rank, layer in enumerate(LAYERS) for name in ((layer,) if isinstance(layer, str) else layer)}
MAX_LINES = 300
GENERATED = {"entrypoints/grpc/proto/engine_pb2.py", "entrypoints/grpc/proto/engine_pb2_grpc.py"}


def module_name(path: Path, root: Path = ENGINE, package: str = PACKAGE) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([package, *parts])


def engine_modules(root: Path = ENGINE, package: str = PACKAGE) -> dict[str, Path]:
    return {module_name(p, root, package): p for p in sorted(root.rglob("*.py"))}


def imported_modules(path: Path, modules: dict[str, Path], root: Path = ENGINE, package: str = PACKAGE) -> set[str]:
    """Modules of `modules` that `path` imports; `from .pkg import name` counts `pkg.name` when that is a module."""
    name = module_name(path, root, package)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [source] + [f"{source}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t in modules and t != name)
    return found


def import_graph(root: Path = ENGINE, package: str = PACKAGE) -> dict[str, set[str]]:
    modules = engine_modules(root, package)
    return {name: imported_modules(path, modules, root, package) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def layer_of(module: str) -> int:
    rest = module.removeprefix(PACKAGE).lstrip(".")
    top = rest.split(".")[0] if "." in rest or rest in _RANKS else ""
    return _RANKS[top]


def test_the_engine_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_layers_import_only_downward():
    upward = [f"{src} imports {dst}" for src, targets in import_graph().items() for dst in sorted(targets)
              if src != PACKAGE and layer_of(dst) < layer_of(src)]
    assert not upward, "\n".join(upward)


def test_the_graph_sees_relative_lazy_and_type_checking_imports():
    graph = import_graph()
    assert f"{PACKAGE}.config" in graph[f"{PACKAGE}.core.llm_engine"]  # from ..config import ...
    assert f"{PACKAGE}.lora.layers" in graph[f"{PACKAGE}.model_executor.models.llama"]  # under TYPE_CHECKING
    assert f"{PACKAGE}.entrypoints.grpc.server" in graph[f"{PACKAGE}.entrypoints.serve"]  # inside a function


@pytest.mark.parametrize("package", sorted(p.parent for p in ENGINE.rglob("__init__.py")), ids=str)
def test_every_package_states_its_job(package: Path):
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text()))
    assert doc and len(doc) > 40, f"{package}/__init__.py needs a docstring saying what the package is for"


def test_modules_are_short_or_say_why_not():
    long = []
    for path in ENGINE.rglob("*.py"):
        rel = path.relative_to(ENGINE).as_posix()
        lines = path.read_text().count("\n")
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if lines > MAX_LINES and rel not in GENERATED and "one piece" not in doc:
            long.append(f"{rel}: {lines} lines")
    assert not long, f"modules over {MAX_LINES} lines (split them, or say in the docstring why they are one piece): {long}"


def test_test_helpers_live_outside_the_engine():
    assert not (ENGINE / "random_model.py").exists()
    assert not any(f"{PACKAGE}.random_model" in targets for targets in import_graph().values())
