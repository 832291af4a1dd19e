"""The `gateway` and `operator` extras of pyproject.toml hold every third-party distribution those parts import.

Their images install only the extra (docker/extra_requirements.py) and the package with --no-deps, so an import
missing from the extra is a crash at start (issue #46: the gateway image had no numpy). The walk starts at every
module of kubeinfer/<part>, follows the kubeinfer modules they import (kubeinfer.common, ...) and collects the
other imports a module runs when it is imported, at module level (not inside functions, not under TYPE_CHECKING).
Import names map to distributions through the installed distributions' file lists (the oracle: pip's RECORDs), so
`yaml` is pyyaml and `google.protobuf` is protobuf."""
from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from functools import lru_cache
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("gateway", "operator")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_path(name: str) -> Path | None:
    base = ROOT.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
                                         or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _run_time(node: ast.AST):
    """The nodes under `node` that can run: all but the bodies of `if TYPE_CHECKING:`."""
    for child in ast.iter_child_nodes(node):
        if _type_checking(child):
            continue
        yield child
        yield from _run_time(child)


def imports_of(path: Path) -> set[str]:
    """Absolute names of the modules `path` imports at run time (relative imports resolved; `from a import b`
    names `a.b` too, which is a module or not)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in _run_time(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            found.add(source)
            found.update(f"{source}.{alias.name}" for alias in node.names)
    return found


def third_party_imports(part: str) -> dict[str, str]:
    """{top-level import name of a non-standard, non-kubeinfer module: the kubeinfer module that imports it}."""
    todo = [module_name(p) for p in sorted((ROOT / "kubeinfer" / part).rglob("*.py"))]
    seen: set[str] = set()
    found: dict[str, str] = {}
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        # importing a.b.c runs a/__init__.py and a/b/__init__.py first
        parents = [".".join(current.split(".")[:i]) for i in range(1, current.count(".") + 1)]
        todo.extend(p for p in parents if p not in seen)
        for imported in imports_of(module_path(current)):
            top = imported.split(".")[0]
            if top == "kubeinfer":
                if module_path(imported) is not None:
                    todo.append(imported)
            elif top not in sys.stdlib_module_names and top != "__future__":
                found.setdefault(imported.rsplit(".", 1)[0] if "." in imported else imported, current)
    return found


@lru_cache(maxsize=1)
def _files_by_distribution() -> dict[str, set[str]]:
    """{module path prefix such as `google/protobuf` or `yaml`: normalized names of the distributions that own it}."""
    owners: dict[str, set[str]] = {}
    for dist in importlib.metadata.distributions():
        name = normalize(dist.metadata["Name"])
        for file in dist.files or ():
            parts = Path(str(file)).with_suffix("").parts
            if not parts or parts[0].endswith((".dist-info", ".data")) or parts[0] in ("..", "bin"):
                continue
            stem = list(parts)
            stem[-1] = stem[-1].split(".")[0]  # yaml/_yaml.cpython-311-x86_64-linux-gnu -> yaml/_yaml
            for i in range(1, len(stem) + 1):
                owners.setdefault("/".join(stem[:i]), set()).add(name)
    return owners


def distributions_of(module: str) -> set[str]:
    """The installed distributions that ship `module` (its longest known prefix), e.g. `google.protobuf.x`."""
    parts = module.split(".")
    owners = _files_by_distribution()
    for i in range(len(parts), 0, -1):
        if "/".join(parts[:i]) in owners:
            found = owners["/".join(parts[:i])]
            if len(found) == 1 or i == len(parts):
                return found
            narrower = owners.get("/".join(parts[:i] + ["__init__"]))
            return narrower or found
    return set()


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def extra(part: str) -> set[str]:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    return {normalize(Requirement(spec).name) for spec in extras[part]}


@pytest.mark.parametrize("part", PARTS)
def test_the_extra_holds_every_third_party_import(part):
    declared = extra(part)
    missing = []
    for module, importer in sorted(third_party_imports(part).items()):
        owners = distributions_of(module)
        assert owners, f"{module} (imported by {importer}) is not installed here: cannot tell its distribution"
        if not owners & declared:
            missing.append(f"{module} (imported by {importer}; distribution {' or '.join(sorted(owners))})")
    assert missing == [], f"add to the {part!r} extra of pyproject.toml: " + "; ".join(missing)


@pytest.mark.parametrize("part", PARTS)
def test_the_extra_keeps_torch_out(part):
    """The images without torch stay so: the walk never reaches the engine."""
    assert not {"torch", "transformers"} & extra(part)
    assert "torch" not in third_party_imports(part)


def test_the_walk_finds_what_the_gateway_imports_through_common(tmp_path):
    found = third_party_imports("gateway")
    assert {"numpy", "yaml", "zmq", "grpc"} <= {m.split(".")[0] for m in found}  # zmq and grpc: via kubeinfer.common
    assert distributions_of("yaml") == {"pyyaml"} and distributions_of("google.protobuf") == {"protobuf"}
    assert distributions_of("zmq") == {"pyzmq"}
    assert {"kubernetes", "httpx"} <= {m.split(".")[0] for m in third_party_imports("operator")}  # inside functions


def test_a_missing_import_fails(monkeypatch):
    """The check itself: numpy taken out of the gateway extra is reported."""
    real = extra("gateway")
    monkeypatch.setitem(globals(), "extra", lambda part: real - {"numpy"})
    with pytest.raises(AssertionError, match="numpy"):
        test_the_extra_holds_every_third_party_import("gateway")


@pytest.mark.parametrize("part", PARTS)
def test_the_image_installs_the_extra_and_no_list_of_its_own(part):
    """docker/<part>.Dockerfile: the extra's requirements (docker/extra_requirements.py), then the package alone."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("extra_requirements", ROOT / "docker" / "extra_requirements.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert {normalize(Requirement(r).name) for r in module.requirements(str(ROOT / "pyproject.toml"), part)} == \
        extra(part)
    text = (ROOT / "docker" / f"{part}.Dockerfile").read_text()
    assert f"extra_requirements.py /src/pyproject.toml {part} > /tmp/requirements.txt" in text
    assert "pip install -r /tmp/requirements.txt" in text and "pip install --no-deps /src" in text
    installs = re.findall(r"pip install ([^\n]*)", text)
    assert all(args.startswith(("-r /tmp/requirements.txt", "--no-deps /src")) for args in installs), installs
