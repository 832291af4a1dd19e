"""docs/architecture.md's recipes name the files a change touches: every repository path it names exists, and
every `name(...)` it says a named module defines is defined there. A move that forgets the recipes fails here."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[2]
DOC = ROOT / "docs" / "architecture.md"
PATH = re.compile(r"`((?:kubeinfer|tests|crds|tools|charts|docker|manifests|benchmarks)/[\w./-]*)`")
TOP_DIRS = ("kubeinfer/", "tests/", "crds/", "tools/", "charts/", "docker/", "manifests/", "benchmarks/")


def named_paths(text: str) -> set[str]:
    found = set(PATH.findall(text))
    found.update(word for line in text.splitlines() for word in line.split() if word.startswith(TOP_DIRS))
    return {path.rstrip(".,;:)`") for path in found if "<" not in path}


def test_every_path_the_recipes_name_exists():
    missing = sorted(path for path in named_paths(DOC.read_text()) if not (ROOT / path).exists())
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


def test_the_recipes_name_paths_at_all():
    """The check above is empty-proof: the recipes name the registries they send a change to."""
    paths = named_paths(DOC.read_text())
    for expected in ("kubeinfer/engine/model_executor/models/registry.py", "kubeinfer/gateway/scheduling/registry.py",
                     "kubeinfer/common/inference_model/fields.py", "kubeinfer/engine/envs.py"):
        assert expected in paths


def test_a_missing_path_is_found():
    assert named_paths("see `kubeinfer/engine/nowhere.py` and kubeinfer/gateway/gone.py.") == {
        "kubeinfer/engine/nowhere.py", "kubeinfer/gateway/gone.py"}


SYMBOLS = [  # (module path, name) the recipes rely on
    ("kubeinfer/engine/entrypoints/serve.py", "def add_serve_arguments"),
    ("kubeinfer/engine/entrypoints/serve.py", "def engine_config"),
    ("kubeinfer/gateway/scheduling/registry.py", "def register_scorer"),
    ("kubeinfer/gateway/scheduling/framework.py", "class Scorer"),
    ("kubeinfer/gateway/flowcontrol/framework.py", "class FlowLayer"),
    ("kubeinfer/engine/model_executor/models/llama.py", "def checkpoint_name"),
    ("kubeinfer/engine/model_executor/models/registry.py", "class Architecture"),
]


def test_the_named_functions_and_classes_exist():
    missing = [f"{path}: {name}" for path, name in SYMBOLS if name not in (ROOT / path).read_text()]
    assert not missing, missing
