"""The gateway's and the operator's layout, with the engine's graph tools (test_engine_layout.py): no import
cycles; the gateway's layers (the Inference Extension endpoint picker's) import only downward; every gateway
package says its one job."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
from test_engine_layout import find_cycle, import_graph

ROOT = Path(__file__).parents[2]
GATEWAY, OPERATOR = ROOT / "kubeinfer" / "gateway", ROOT / "kubeinfer" / "operator"
GATEWAY_PACKAGE = "kubeinfer.gateway"
# Top to bottom; a module may import its own layer or any below. app.py and cli.py (and the package
# itself) are the top: they assemble the rest.
GATEWAY_LAYERS = ("", "handlers", "flowcontrol", "scheduling", "datastore")


def gateway_layer(module: str) -> int:
    rest = module.removeprefix(GATEWAY_PACKAGE).lstrip(".")
    top = rest.split(".")[0] if "." in rest or rest in GATEWAY_LAYERS else ""
    return GATEWAY_LAYERS.index(top)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return [f"{src} imports {dst}" for src, targets in graph.items() for dst in sorted(targets)
            if gateway_layer(dst) < gateway_layer(src)]


@pytest.mark.parametrize("root,package", [(GATEWAY, GATEWAY_PACKAGE), (OPERATOR, "kubeinfer.operator")],
                         ids=["gateway", "operator"])
def test_no_import_cycle(root, package):
    cycle = find_cycle(import_graph(root, package))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_gateway_layers_import_only_downward():
    assert not upward_imports(import_graph(GATEWAY, GATEWAY_PACKAGE))


def test_the_layer_check_sees_an_upward_import():
    graph = {f"{GATEWAY_PACKAGE}.datastore.scraper": {f"{GATEWAY_PACKAGE}.handlers.upstream"},
             f"{GATEWAY_PACKAGE}.handlers.forward": {f"{GATEWAY_PACKAGE}.datastore.endpoints"},
             f"{GATEWAY_PACKAGE}.app": {f"{GATEWAY_PACKAGE}.handlers.proxy"}}
    assert upward_imports(graph) == [f"{GATEWAY_PACKAGE}.datastore.scraper imports {GATEWAY_PACKAGE}.handlers.upstream"]


def test_the_gateway_graph_sees_its_relative_imports():
    graph = import_graph(GATEWAY, GATEWAY_PACKAGE)
    assert f"{GATEWAY_PACKAGE}.datastore.endpoints" in graph[f"{GATEWAY_PACKAGE}.scheduling.picker"]
    assert f"{GATEWAY_PACKAGE}.handlers.upstream" in graph[f"{GATEWAY_PACKAGE}.cli"]  # inside a function


def test_only_the_assembly_sits_at_the_gateway_top():
    top = sorted(p.name for p in GATEWAY.glob("*.py"))
    assert top == ["__init__.py", "app.py", "cli.py"], top


@pytest.mark.parametrize("package", sorted(p.parent for p in GATEWAY.rglob("__init__.py")), ids=str)
def test_every_gateway_package_states_its_job(package: Path):
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text()))
    assert doc and len(doc) > 40, f"{package}/__init__.py needs a docstring saying what the package is for"
