"""Compiles kernels.c (with the files it #includes: SOURCES) into a shared library with the system C compiler,
once per source, compiler, flags and CPU: the library is cached under $KUBEINFER_CACHE_DIR or
~/.cache/kubeinfer/cpu_native/<key>/,
the key a hash of those (the CPU's feature flags: -march=native code never runs on another CPU). `-O3
-march=native`: AVX-512 VNNI intrinsics where the CPU has them, the portable C twins elsewhere;
KUBEINFER_CPU_NATIVE_PORTABLE=1 builds the portable C on any CPU (for tests).
KUBEINFER_CPU_NATIVE_SANITIZE=address builds it with AddressSanitizer (`make test-asan`; cached apart, its flags
in the key): python must run with LD_PRELOAD of `gcc -print-file-name=libasan.so` (the runtime first), and a
sanitized library that does not load is an error (ops.library), never a silent fall back to torch's kernels.
No compiler, or a failed build: `load()` returns None with the reason (ops.py warns once and the torch
kernels run).
A prebuilt library (KUBEINFER_CPU_NATIVE_LIBRARY; the CPU engine image builds one in its build stage with
`python -m ...cpu_native.build --out DIR`, its serving stage has no compiler) is loaded first where its manifest
(libkubeinfer_cpu.json beside it) names these sources and a CPU whose feature flags this CPU all has: -march=native
code from another CPU family would die on an illegal instruction."""
from __future__ import annotations

import ctypes
import hashlib
import json
import os
import sys
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import kubeinfer.engine.envs as envs

SOURCES = ("kernels.c", "kernels_q8_0.c", "attention.c", "decode_ops.c", "decoder_layer.c", "f32_linear.c",
           "a16_linear.c", "a16_tiles.c", "w4a8_linear.c")
HERE = Path(__file__).parent


SANITIZERS = envs.SANITIZERS


def flags(portable: bool, sanitizer: str | None = None) -> list[str]:
    native = ["-march=native"] if platform.machine() in ("x86_64", "AMD64", "i686") else ["-mcpu=native"]
    checked = [f"-fsanitize={sanitizer}", "-fno-omit-frame-pointer", "-g"] if sanitizer else []
    return ["-O3", *native, "-ffp-contract=off", "-fPIC", "-shared", "-pthread", "-std=gnu11",
            *(["-DKI_PORTABLE"] if portable else []), *checked]


def sanitizer() -> str | None:
    """KUBEINFER_CPU_NATIVE_SANITIZE: None (the default, unset or empty) or a sanitizer of SANITIZERS."""
    return envs.CPU_NATIVE_SANITIZE.get()


def portable_requested() -> bool:
    return envs.CPU_NATIVE_PORTABLE.get()


def cache_root() -> Path:
    return Path(envs.CACHE_DIR.get()) / "cpu_native"


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def _cpu_features() -> str:
    """The CPU's feature flags: -march=native code must not be reused on another CPU (a home shared by nodes)."""
    try:
        with open("/proc/cpuinfo") as info:
            return next((line for line in info if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def sources_digest() -> str:
    digest = hashlib.sha256()
    for source in SOURCES:
        digest.update((HERE / source).read_bytes())
    return digest.hexdigest()


def _flag_set(line: str) -> set[str]:
    return set(line.partition(":")[2].split())


def manifest_path(library: Path) -> Path:
    return library.with_suffix(".json")


def prebuilt(portable: bool) -> tuple[Path | None, str]:
    """(KUBEINFER_CPU_NATIVE_LIBRARY's library, "") where it fits these sources and this CPU, else (None, why)."""
    named = envs.CPU_NATIVE_LIBRARY.get()
    if named is None:
        return None, "KUBEINFER_CPU_NATIVE_LIBRARY is unset"
    library = Path(named)
    try:
        manifest = json.loads(manifest_path(library).read_text())
    except (OSError, ValueError) as exc:
        return None, f"prebuilt library {library} has no readable manifest: {exc}"
    if not library.is_file():
        return None, f"prebuilt library {library} does not exist"
    if manifest.get("sources") != sources_digest():
        return None, f"prebuilt library {library} was built from other sources than this package's"
    if manifest.get("portable") != portable or manifest.get("machine") != platform.machine():
        return None, f"prebuilt library {library} was built for {manifest.get('machine')}" + (
            ", portable" if manifest.get("portable") else "") + ", not for this run"
    missing = _flag_set(manifest.get("cpu_flags", "")) - _flag_set(_cpu_features())
    if missing:
        return None, (f"prebuilt library {library} needs CPU features this CPU lacks: "
                      + " ".join(sorted(missing)[:8]) + (" ..." if len(missing) > 8 else ""))
    return library, ""


def export(out_dir: Path, portable: bool | None = None) -> Path:
    """Build (or take from the cache) the library and copy it with its manifest into out_dir: a prebuilt library
    for KUBEINFER_CPU_NATIVE_LIBRARY."""
    portable = portable_requested() if portable is None else portable
    built = build(portable)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / built.name
    shutil.copyfile(built, target)
    manifest = {"sources": sources_digest(), "cpu_flags": _cpu_features().strip(), "portable": portable,
                "machine": platform.machine()}
    manifest_path(target).write_text(json.dumps(manifest, indent=1) + "\n")
    return target


def build(portable: bool | None = None) -> Path:
    """The compiled library's path, compiling it when the cache has none. Raises RuntimeError on failure."""
    portable = portable_requested() if portable is None else portable
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (gcc or cc on PATH, or $CC)")
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"C compiler {cc} does not run: {exc}") from exc
    args = flags(portable, sanitizer())
    digest = hashlib.sha256()
    for part in [*(HERE / s for s in SOURCES)]:
        digest.update(part.read_bytes())
    digest.update(version.encode())
    digest.update(" ".join([cc, *args, platform.machine(), _cpu_features()]).encode())
    target = cache_root() / digest.hexdigest()[:20] / "libkubeinfer_cpu.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # then renamed: concurrent builds never see half
        out = Path(tmp) / target.name
        done = subprocess.run([cc, *args, "-o", str(out), str(HERE / SOURCES[0]), "-lm"], capture_output=True,
                              text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed to build {SOURCES[0]}: {done.stderr.strip()[-2000:]}")
        os.replace(out, target)
    return target


# Where the library that load() returned came from: "prebuilt PATH" or "built PATH" (ops.native_paths says it).
origin: dict[str, str] = {}


def load(portable: bool | None = None) -> tuple[ctypes.CDLL | None, str]:
    """(the library, "") or (None, why not): the prebuilt one where it fits (not for a sanitized run), else built."""
    portable = portable_requested() if portable is None else portable
    skipped = ""
    if sanitizer() is None and envs.CPU_NATIVE_LIBRARY.get() is not None:
        library, skipped = prebuilt(portable)
        if library is not None:
            try:
                lib = ctypes.CDLL(str(library))
                origin["library"] = f"prebuilt {library}"
                return lib, ""
            except OSError as exc:
                skipped = f"prebuilt library {library} does not load: {exc}"
    try:
        path = build(portable)
        lib = ctypes.CDLL(str(path))
        origin["library"] = f"built {path}" + (f" ({skipped})" if skipped else "")
        return lib, ""
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        return None, f"{skipped}; {exc}" if skipped else str(exc)


if __name__ == "__main__":  # `make setup` builds it ahead of first use; `--out DIR` exports a prebuilt library
    if sys.argv[1:2] == ["--out"] and len(sys.argv) == 3:
        exported = export(Path(sys.argv[2]))
        print(f"cpu_native kernels: {exported} (manifest {manifest_path(exported).name})")
        sys.exit(0)
    lib, why = load()
    print(f"cpu_native kernels: {'built' if lib else 'not built: ' + why}"
          + (f" (VNNI: {bool(lib.ki_has_vnni())})" if lib else ""))
