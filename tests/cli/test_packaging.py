"""Every Python package in the tree is listed in pyproject.toml: setuptools is given an explicit list
(the three folders map to subpackages of `kubeinfer`), so a package left out installs fine in editable
mode and goes missing from a wheel or a container image (kubeinfer.engine.spec_decode did)."""
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_is_listed_for_setuptools():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {path: name for name, path in tool["package-dir"].items()}
    found = set()
    for folder, package in folders.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            if ".venv" not in parts and "build" not in parts:
                found.add(".".join((package, *parts)))
    assert found - set(tool["packages"]) == set(), "add these to [tool.setuptools] packages"
