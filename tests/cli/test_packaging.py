"""Every Python package in the tree is found by setuptools and every file it reads at run time is shipped: the
folders are the import names (kubeinfer/{engine,gateway,operator,...}, no package-dir mapping) and setuptools finds
the packages under kubeinfer/, so a folder without an `__init__.py` installs fine in editable mode and goes missing
from a wheel or a container image (kubeinfer.engine.spec_decode did, when the packages were an explicit list)."""
import fnmatch
import tomllib
from pathlib import Path

from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[2]
TOOL = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def source_folders() -> dict[str, Path]:
    """Every folder under kubeinfer/ that holds Python or data files, by its import name."""
    folders = {}
    for path in (ROOT / "kubeinfer").rglob("*"):
        if path.is_file() and "__pycache__" not in path.parts:
            folders[".".join(path.parent.relative_to(ROOT).parts)] = path.parent
    return folders


def test_every_package_is_found_by_setuptools():
    assert "package-dir" not in TOOL, "the folders are the import names: no package-dir mapping"
    assert TOOL["packages"]["find"]["include"] == ["kubeinfer", "kubeinfer.*"]
    found = set(find_packages(str(ROOT), include=TOOL["packages"]["find"]["include"]))
    assert set(source_folders()) - found == set(), "add an __init__.py to these folders"
    # The gRPC .proto and the native library's C sources are read at run time: package-data must name them.
    data = TOOL["package-data"]
    missing = [str(path.relative_to(ROOT)) for package, folder in source_folders().items()
               for path in folder.iterdir()
               if path.is_file() and path.suffix not in (".py", ".pyc")
               and not any(fnmatch.fnmatch(path.name, pattern) for pattern in data.get(package, []))]
    assert missing == [], "add these to [tool.setuptools.package-data]"
