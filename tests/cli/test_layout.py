"""The layout between the parts, with the engine's graph tools (test_engine_layout.py): the product (engine,
gateway, operator and what they share, common) never imports the developer tools in kubeinfer.dev, and the CLI
only inside the dev subcommands; common imports none of the parts; the packages under kubeinfer/ import one
another without a cycle, and common's modules too; KUBEINFER_* variables are read only through their
declarations (kubeinfer/engine/envs.py, kubeinfer/common/envs.py)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
from test_engine_layout import find_cycle, import_graph, module_name

KUBEINFER = Path(__file__).parents[2] / "kubeinfer"
PRODUCT = ("engine", "gateway", "operator", "common")
PARTS = ("engine", "gateway", "operator", "cli", "dev")  # what common must not import
ENVS_MODULES = {"kubeinfer/engine/envs.py", "kubeinfer/common/envs.py"}  # the only readers of KUBEINFER_* variables


def package_of(module: str) -> str:
    """`kubeinfer.gateway.app` -> `gateway`; the root package and top-level modules (`kubeinfer.cli`) by name."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def module_level_imports(path: Path) -> set[str]:
    """Modules named by the imports a module runs when it is imported: not those inside functions."""
    tree = ast.parse(path.read_text(), str(path))
    lazy = {id(node) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
            for node in ast.walk(fn)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in lazy:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.update([node.module, *(f"{node.module}.{alias.name}" for alias in node.names)])
    return found


def _is_environ(node: ast.AST) -> bool:
    """`os.environ` or a bare `environ` (`from os import environ`)."""
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (isinstance(node, ast.Name)
                                                                            and node.id == "environ")


def _is_getenv(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "getenv") or (isinstance(node, ast.Name)
                                                                           and node.id == "getenv")


def kubeinfer_env_reads(source: str, where: str) -> list[str]:
    """Reads of a KUBEINFER_* variable, named by a literal or a module-level constant holding one:
    os.environ[NAME] (not an assignment), os.environ.get(NAME), os.getenv(NAME), NAME in os.environ."""
    tree = ast.parse(source, where)
    constants = {target.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
                 and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
                 for target in node.targets if isinstance(target, ast.Name)}

    def kubeinfer_name(node: ast.AST) -> str | None:
        value = node.value if isinstance(node, ast.Constant) else constants.get(getattr(node, "id", None))
        return value if isinstance(value, str) and value.startswith("KUBEINFER_") else None

    found = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value):
            key = node.slice
        elif isinstance(node, ast.Call) and node.args and (
                _is_getenv(node.func) or (isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                                          and _is_environ(node.func.value))):
            key = node.args[0]
        elif (isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.In, ast.NotIn))
              and _is_environ(node.comparators[0])):
            key = node.left
        name = kubeinfer_name(key) if key is not None else None
        if name:
            found.append(f"{where}:{node.lineno} reads {name}")
    return found


def imports_of_dev(graph: dict[str, set[str]], paths: dict[str, Path]) -> list[str]:
    """Product modules that import kubeinfer.dev at all, and other non-dev modules (the CLI) that do so when they
    are imported."""
    found = []
    for src, targets in graph.items():
        if package_of(src) == "dev":
            continue
        dev = sorted(t for t in targets if package_of(t) == "dev")
        if package_of(src) not in PRODUCT:
            dev = sorted(t for t in module_level_imports(paths[src]) if package_of(t) == "dev")
        found += [f"{src} imports {t}" for t in dev]
    return found


def common_imports_of_parts(graph: dict[str, set[str]]) -> list[str]:
    return [f"{src} imports {t}" for src, targets in graph.items() if package_of(src) == "common"
            for t in sorted(targets) if package_of(t) in PARTS]


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph folded onto the packages under kubeinfer/ (the root package's own module is `""`)."""
    folded: dict[str, set[str]] = {}
    for src, targets in graph.items():
        folded.setdefault(package_of(src), set()).update(package_of(t) for t in targets)
    return {package: targets - {package} for package, targets in folded.items()}


@pytest.fixture(scope="module")
def tree() -> tuple[dict[str, set[str]], dict[str, Path]]:
    paths = {module_name(p, KUBEINFER, "kubeinfer"): p for p in sorted(KUBEINFER.rglob("*.py"))}
    return import_graph(KUBEINFER, "kubeinfer"), paths


def test_the_product_does_not_import_the_dev_tools(tree):
    graph, paths = tree
    found = imports_of_dev(graph, paths)
    assert not found, "move what the product needs out of kubeinfer.dev:\n" + "\n".join(found)


def test_common_imports_none_of_the_parts(tree):
    graph, _ = tree
    found = common_imports_of_parts(graph)
    assert not found, "common holds what the parts share and sits below them all:\n" + "\n".join(found)


def test_the_packages_import_one_another_without_a_cycle(tree):
    graph, _ = tree
    cycle = find_cycle(package_graph(graph))
    assert cycle is None, "import cycle between packages: " + " -> ".join(cycle)


def test_common_has_no_import_cycle():
    cycle = find_cycle(import_graph(KUBEINFER / "common", "kubeinfer.common"))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_only_the_cli_and_the_packages_sit_at_the_top():
    top = {p.name for p in KUBEINFER.glob("*.py")}
    assert top <= {"__init__.py", "cli.py"}, f"put {sorted(top - {'__init__.py', 'cli.py'})} in a package"
    assert {"engine", "gateway", "operator", "common", "dev"} <= {p.name for p in KUBEINFER.iterdir() if p.is_dir()}


def test_kubeinfer_variables_are_read_only_through_their_declarations():
    root = KUBEINFER.parent
    found = [read for path in sorted(KUBEINFER.rglob("*.py")) if path.relative_to(root).as_posix() not in ENVS_MODULES
             for read in kubeinfer_env_reads(path.read_text(), path.relative_to(root).as_posix())]
    assert not found, "declare the variable in kubeinfer/engine/envs.py (or common/envs.py) and read it there:\n" + \
        "\n".join(found)


def test_the_env_read_check_sees_reads_and_not_writes():
    planted = ('import os\nfrom os import environ, getenv\nNAME = "KUBEINFER_X"\n'
               'a = os.environ["KUBEINFER_A"]\nb = os.environ.get("KUBEINFER_B", "1")\nc = os.getenv(NAME)\n'
               'd = getenv("KUBEINFER_D")\ne = "KUBEINFER_E" in environ\n'
               'os.environ["KUBEINFER_W"] = "1"\nos.environ.setdefault("KUBEINFER_S", "1")\n'
               'f = os.environ.get("OMP_NUM_THREADS")\n')
    assert kubeinfer_env_reads(planted, "m.py") == [
        "m.py:4 reads KUBEINFER_A", "m.py:5 reads KUBEINFER_B", "m.py:6 reads KUBEINFER_X",
        "m.py:7 reads KUBEINFER_D", "m.py:8 reads KUBEINFER_E"]


def test_the_checks_see_violations(tmp_path):
    """Each check fails on a planted violation: a gateway module importing dev lazily, the CLI importing dev when
    it is imported (and not when a dev subcommand imports it inside a function), common importing the engine, and
    two packages importing each other."""
    cli = tmp_path / "cli.py"
    cli.write_text("import kubeinfer.dev.local_stack\n\ndef run():\n    from kubeinfer.dev.testing import random_model\n")
    lazy_cli = tmp_path / "lazy_cli.py"
    lazy_cli.write_text("def run():\n    from kubeinfer.dev.testing import random_model\n")
    graph = {"kubeinfer.gateway.app": {"kubeinfer.dev.demo"}, "kubeinfer.cli": {"kubeinfer.dev.local_stack"},
             "kubeinfer.lazy_cli": {"kubeinfer.dev.testing.random_model"}, "kubeinfer.dev.demo": {"kubeinfer.engine"}}
    paths = {"kubeinfer.cli": cli, "kubeinfer.lazy_cli": lazy_cli}
    assert imports_of_dev(graph, paths) == ["kubeinfer.gateway.app imports kubeinfer.dev.demo",
                                            "kubeinfer.cli imports kubeinfer.dev.local_stack"]
    assert common_imports_of_parts({"kubeinfer.common.http_guard": {"kubeinfer.engine.config"}}) == [
        "kubeinfer.common.http_guard imports kubeinfer.engine.config"]
    folded = package_graph({"kubeinfer.common.x": {"kubeinfer.gateway.app", "kubeinfer.common.y"},
                            "kubeinfer.gateway.app": {"kubeinfer.common.y"}, "kubeinfer.common.y": set()})
    assert folded == {"common": {"gateway"}, "gateway": {"common"}}
    assert find_cycle(folded) == ["common", "gateway", "common"]
