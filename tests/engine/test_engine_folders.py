"""The engine's folders, read from the module graph of test_engine_layout.py: no import cycle between two folders
(a package and its subpackages excepted: a package's __init__ re-exports them, they import its shared modules),
and no model definition importing a device backend (models/ call the hooks of platforms/__init__.py)."""
from __future__ import annotations

from test_engine_layout import ENGINE, PACKAGE, engine_modules, find_cycle, import_graph

MODELS = f"{PACKAGE}.model_executor.models"
BACKENDS = (f"{PACKAGE}.platforms.cpu", f"{PACKAGE}.platforms.cuda")
# The one pair of folders still read both ways: the platforms' decoder fast path and Triton backends check and
# subclass the layers' types (RMSNorm, RotaryEmbedding, AttentionBackend, W4A8Method, ...) while the layers call
# the platforms' kernels. These directed edges are tolerated; any other folder cycle fails.
TOLERATED = {("platforms/cpu", "model_executor/layers"), ("platforms/cpu", "model_executor/layers/quantization"),
             ("platforms/cpu/native", "model_executor/layers/quantization"), ("platforms/cuda", "model_executor/layers")}


def nested(a: str, b: str) -> bool:
    """Whether one folder is the other or holds it ("" is the engine's own folder)."""
    return a == b or not a or not b or a.startswith(b + "/") or b.startswith(a + "/")


def folder_graph(graph: dict[str, set[str]], folder_of: dict[str, str]) -> dict[str, set[str]]:
    folders: dict[str, set[str]] = {folder: set() for folder in folder_of.values()}
    for src, targets in graph.items():
        for dst in targets:
            a, b = folder_of[src], folder_of[dst]
            if not nested(a, b) and (a, b) not in TOLERATED:
                folders[a].add(b)
    return folders


def engine_folders() -> dict[str, str]:
    return {name: path.parent.relative_to(ENGINE).as_posix().removeprefix(".")
            for name, path in engine_modules().items()}


def test_no_import_cycle_between_the_engines_folders():
    cycle = find_cycle(folder_graph(import_graph(), engine_folders()))
    assert cycle is None, "import cycle between folders: " + " -> ".join(cycle)


def test_the_folder_check_sees_a_cycle_and_ignores_nesting():
    folder_of = {"a.x": "a", "a.y": "a", "b.z": "b", "a.sub.w": "a/sub"}
    assert find_cycle(folder_graph({"a.x": {"b.z"}, "b.z": {"a.y"}, "a.y": set()}, folder_of)) == ["a", "b", "a"]
    assert find_cycle(folder_graph({"a.x": {"a.sub.w"}, "a.sub.w": {"a.y"}, "a.y": set()}, folder_of)) is None


def backend_imports_of_models(graph: dict[str, set[str]]) -> list[str]:
    return [f"{src} imports {dst}" for src, targets in graph.items() if src.startswith(MODELS + ".")
            for dst in sorted(targets) if dst.startswith(BACKENDS)]


def test_models_call_platform_hooks_never_a_backend_module():
    found = backend_imports_of_models(import_graph())
    assert not found, "call a hook of kubeinfer/engine/platforms/__init__.py instead:\n" + "\n".join(found)


def test_the_backend_check_sees_a_model_importing_a_backend():
    graph = {f"{MODELS}.llama": {f"{PACKAGE}.platforms.cpu.native_decode", f"{PACKAGE}.platforms"},
             f"{PACKAGE}.model_executor.model_runner": {f"{PACKAGE}.platforms.cpu.cpu_blas"}}
    assert backend_imports_of_models(graph) == [f"{MODELS}.llama imports {PACKAGE}.platforms.cpu.native_decode"]
