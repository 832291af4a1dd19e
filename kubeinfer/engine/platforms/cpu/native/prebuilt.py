"""Libraries built ahead of time, so that a serving node needs no C compiler: the package build and the CPU
image's build stage run `python -m kubeinfer.engine.platforms.cpu.native.prebuilt`, which compiles every x86-64
level into prebuilt/ beside the sources, with a stamp of the sources they came from. At run time build.py takes a
level's prebuilt library when the stamp matches the sources here; a source edited since (a developer's tree)
makes the stamp stale and the runtime build takes over, as does a sanitized build (never prebuilt)."""
from __future__ import annotations

import hashlib
import platform
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).parent
PREBUILT = HERE / "prebuilt"
STAMP = "SOURCES.sha256"


def sources_digest(sources: tuple[str, ...], header: str) -> str:
    digest = hashlib.sha256()
    for name in (*sources, header):
        digest.update(name.encode() + b"\0" + (HERE / name).read_bytes())
    return digest.hexdigest()


def library_name(level: str) -> str:
    return f"libkubeinfer_cpu_{level}.so"


def prebuilt_library(level: str, digest: str, where: Path | None = None) -> Path | None:
    """`level`'s prebuilt library where its stamp is `digest` (the sources' now); None otherwise."""
    where = PREBUILT if where is None else where
    library, stamp = where / library_name(level), where / STAMP
    try:
        fresh = stamp.read_text().strip() == digest
    except OSError:
        return None
    return library if fresh and library.exists() else None


def prebuild(where: Path | None = None, levels: list[str] | None = None) -> list[Path]:
    """Compile `levels` (default: every x86-64 level) and copy them into `where` (default prebuilt/) with the
    stamp; raises RuntimeError when one does not build."""
    from . import build  # build.py imports this module for prebuilt_library

    where = PREBUILT if where is None else where
    levels = list(build.LEVELS) if levels is None else levels
    where.mkdir(parents=True, exist_ok=True)
    (where / STAMP).unlink(missing_ok=True)  # stale until every library is in place
    copied = []
    for level in levels:
        built = build.compile_level(level)
        copied.append(Path(shutil.copyfile(built, where / library_name(level))))
    (where / STAMP).write_text(sources_digest(build.SOURCES, build.HEADER) + "\n")
    return copied


if __name__ == "__main__":
    if platform.machine() not in ("x86_64", "AMD64"):
        sys.exit(f"prebuilt levels are x86-64 builds; this machine is {platform.machine()} (its one native build "
                 "is compiled at first use)")
    for path in prebuild():
        print(f"prebuilt {path}")
