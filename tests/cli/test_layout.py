"""The layout between the parts, with the engine's graph tools (test_engine_layout.py): the product (engine,
gateway, operator and what they share, common) never imports the developer tools in kubeinfer.dev, and the CLI
only inside the dev subcommands; common imports none of the parts; the packages under kubeinfer/ import one
another without a cycle, and common's modules too."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
from test_engine_layout import find_cycle, import_graph, module_name

KUBEINFER = Path(__file__).parents[2] / "kubeinfer"
PRODUCT = ("engine", "gateway", "operator", "common")
PARTS = ("engine", "gateway", "operator", "cli", "dev")  # what common must not import


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
