"""Libraries built ahead of time, so that a serving node needs no C compiler: the package build and the CPU
image's build stage run `python -m kubeinfer.engine.platforms.cpu.native.build --prebuild` (build.prebuild), which
compiles every x86-64 level into prebuilt/ beside the sources, with a stamp of the sources they came from. At run time build.py takes a
level's prebuilt library when the stamp matches the sources here; a source edited since (a developer's tree)
makes the stamp stale and the runtime build takes over, as does a sanitized build (never prebuilt)."""
from __future__ import annotations

import hashlib
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
