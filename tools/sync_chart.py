"""Copy the files the Helm chart ships from their sources of truth into charts/kubeinfer/.

A chart can only read files inside its own directory, so the CRDs (crds/), the Grafana dashboard and
the alert rules (manifests/) are copied in, byte for byte. tests/chart/test_chart.py fails while a copy is
stale; this script fixes it:

    python tools/sync_chart.py          # copy
    python tools/sync_chart.py --check  # list stale copies, exit 1 if any
"""
from __future__ import annotations

import argparse
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
CHART = REPO_ROOT / "charts" / "kubeinfer"


@dataclass(frozen=True)
class Copy:
    source: Path
    target: Path


def planned_copies(root: Path = REPO_ROOT) -> list[Copy]:
    """Every (source, copy) pair: each CRD, the dashboard and the alert rules."""
    chart = root / "charts" / "kubeinfer"
    copies = [Copy(crd, chart / "crds" / crd.name) for crd in sorted((root / "crds").glob("*.yaml"))]
    copies.append(Copy(root / "manifests" / "dashboards" / "kubeinfer.json", chart / "files" / "kubeinfer.json"))
    copies.append(Copy(root / "manifests" / "alerts" / "kubeinfer-rules.yaml", chart / "files" / "kubeinfer-rules.yaml"))
    return copies


def orphaned_crds(root: Path = REPO_ROOT) -> list[Path]:
    """CRDs in the chart whose source was removed from crds/."""
    sources = {crd.name for crd in (root / "crds").glob("*.yaml")}
    return sorted(p for p in (root / "charts" / "kubeinfer" / "crds").glob("*.yaml") if p.name not in sources)


def stale(root: Path = REPO_ROOT) -> list[str]:
    """Human-readable problems: copies missing or different from their source, and orphaned copies."""
    problems = []
    for copy in planned_copies(root):
        if not copy.source.is_file():
            problems.append(f"{copy.source.relative_to(root)} is missing")
        elif not copy.target.is_file() or copy.target.read_bytes() != copy.source.read_bytes():
            problems.append(f"{copy.target.relative_to(root)} differs from {copy.source.relative_to(root)}")
    problems += [f"{p.relative_to(root)} has no source in crds/" for p in orphaned_crds(root)]
    return problems


def sync(root: Path = REPO_ROOT) -> list[Path]:
    """Make every copy equal to its source; returns the paths written or removed."""
    changed = []
    for copy in planned_copies(root):
        if not copy.source.is_file():
            raise FileNotFoundError(f"{copy.source} is missing: nothing to copy into the chart")
        if not copy.target.is_file() or copy.target.read_bytes() != copy.source.read_bytes():
            copy.target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(copy.source, copy.target)
            changed.append(copy.target)
    for orphan in orphaned_crds(root):
        orphan.unlink()
        changed.append(orphan)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Copy CRDs, dashboard and alert rules into the Helm chart.")
    parser.add_argument("--check", action="store_true", help="only report stale copies (exit 1 if any)")
    args = parser.parse_args(argv)
    if args.check:
        problems = stale()
        for problem in problems:
            print(problem)
        return 1 if problems else 0
    for path in sync():
        print(f"updated {path.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
