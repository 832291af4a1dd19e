"""Print one extra's requirements from pyproject.toml (or with --dependencies, the package's own), one a line, for
`pip install -r`.

The gateway and operator images install their extra's requirements and then the package with `--no-deps`:
`pip install '.[gateway]'` would also pull the package's own dependencies (torch, transformers), which only the
engine needs. The engine image installs --dependencies before copying the code, so a code change reuses that layer.
Usage (in a Dockerfile's build stage): python extra_requirements.py PYPROJECT EXTRA|--dependencies > req.txt
"""
from __future__ import annotations

import sys
import tomllib


def requirements(pyproject: str, extra: str) -> list[str]:
    with open(pyproject, "rb") as f:
        project = tomllib.load(f)["project"]
    if extra == "--dependencies":
        return list(project["dependencies"])
    extras = project["optional-dependencies"]
    if extra not in extras:
        raise SystemExit(f"extra_requirements: pyproject.toml has no extra {extra!r} (it has: {', '.join(extras)})")
    return list(extras[extra])


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: extra_requirements.py PYPROJECT EXTRA|--dependencies")
    print("\n".join(requirements(sys.argv[1], sys.argv[2])))
