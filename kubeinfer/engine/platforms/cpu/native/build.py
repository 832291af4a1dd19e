"""Compiles kernels.c (with the files it #includes: SOURCES) into a shared library with the system C compiler,
one library per x86-64 level (LEVELS: v4 AVX-512 with VNNI and BF16, v3 AVX2/FMA/F16C, portable C), each built
once per source, compiler and flags: cached under $KUBEINFER_CACHE_DIR or ~/.cache/kubeinfer/cpu_native/<key>/,
the key a hash of those. The level loaded is the best one the CPU's flags (/proc/cpuinfo: the kernel's cpuid
view) allow, or KUBEINFER_CPU_LEVEL's (a level the CPU lacks is refused: its code would stop the process on an
illegal instruction); `chosen_level()` says which and why, without building. Other machines (arm64) keep one
`-mcpu=native` build, keyed by the CPU's flags as well (native code never runs on another CPU).
KUBEINFER_CPU_NATIVE_PORTABLE=1 builds the portable C on any CPU (for tests), as KUBEINFER_CPU_LEVEL=portable.
KUBEINFER_CPU_NATIVE_SANITIZE=address builds it with AddressSanitizer (`make test-asan`; cached apart, its flags
in the key): python must run with LD_PRELOAD of `gcc -print-file-name=libasan.so` (the runtime first), and a
sanitized library that does not load is an error (ops.library), never a silent fall back to torch's kernels.
A level's library built ahead of time (prebuilt.py: the package build, the CPU image) is taken first, where its
stamp matches the sources. No compiler, or a failed build: `load()` returns None with the reason (ops.py warns
once and the torch kernels run)."""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import kubeinfer.engine.envs as envs

from . import prebuilt

SOURCES = ("kernels.c", "kernels_q8_0.c", "attention.c", "decode_ops.c", "decoder_layer.c", "f32_linear.c",
           "a16_linear.c", "a16_tiles.c", "a16_avx2.c", "w4a8_linear.c")
HEADER = "kubeinfer_cpu.h"  # every source includes it: part of the cache key
HERE = Path(__file__).parent


SANITIZERS = envs.SANITIZERS


X86 = ("x86_64", "AMD64", "i686")
# Each level's compiler flags and the /proc/cpuinfo flags it needs (x86-64-v3 and -v4 as the psABI defines them;
# v4 here also needs VNNI and BF16, which the kernels' AVX-512 paths use: an AVX-512 CPU without them takes v3).
LEVELS: dict[str, tuple[list[str], tuple[str, ...]]] = {
    "v4": (["-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16"],
           ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_vnni", "avx512_bf16")),
    "v3": (["-march=x86-64-v3"], ("avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm")),
    "portable": ([], ()),
}


def flags(portable: bool, sanitizer: str | None = None, level: str | None = None) -> list[str]:
    """The compiler's flags for `level` (x86: v4, v3, portable; None: this machine's -march/-mcpu=native)."""
    if portable:
        level = "portable"
    if level is None:
        arch = ["-march=native"] if platform.machine() in X86 else ["-mcpu=native"]
    else:
        arch = LEVELS[level][0]
    checked = [f"-fsanitize={sanitizer}", "-fno-omit-frame-pointer", "-g"] if sanitizer else []
    return ["-O3", *arch, "-ffp-contract=off", "-fPIC", "-shared", "-pthread", "-std=gnu11",
            *(["-DKI_PORTABLE"] if level == "portable" else []), *checked]


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's feature flags, from /proc/cpuinfo's first `flags` line (or `cpuinfo`, the file's text: tests)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as info:
                cpuinfo = info.read()
        except OSError:
            return set()
    line = next((ln for ln in cpuinfo.splitlines() if ln.startswith(("flags", "Features"))), "")
    return set(line.partition(":")[2].split())


def best_level(features: set[str]) -> str:
    """The highest level whose flags the CPU has (portable where it has neither v3's nor v4's)."""
    return next(level for level, (_, needs) in LEVELS.items() if set(needs) <= features)


def chosen_level(cpuinfo: str | None = None, machine: str | None = None) -> tuple[str | None, str]:
    """(the level to load, why); level None: this machine is not x86 (one native build) or the level asked for
    (KUBEINFER_CPU_LEVEL) is one this CPU lacks, the reason saying which flags are missing."""
    if (machine or platform.machine()) not in X86:
        return None, f"{machine or platform.machine()}: one -mcpu=native build"
    features = cpu_flags(cpuinfo)
    wanted = "portable" if portable_requested() else envs.CPU_LEVEL.get()
    if wanted is None:
        level = best_level(features)
        return level, f"the best level of this CPU's flags ({' '.join(LEVELS[level][1]) or 'no AVX2'})"
    missing = sorted(set(LEVELS[wanted][1]) - features)
    if missing:
        return None, f"KUBEINFER_CPU_LEVEL={wanted} but this CPU lacks {', '.join(missing)}"
    return wanted, "KUBEINFER_CPU_LEVEL" if envs.CPU_LEVEL.get() else "KUBEINFER_CPU_NATIVE_PORTABLE"


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


def build(portable: bool | None = None, level: str | None = None) -> Path:
    """The compiled library's path for `level` (None: chosen_level()'s), compiling it when the cache has none.
    Raises RuntimeError on failure, or where the level chosen is one this CPU lacks."""
    if portable or (portable is None and portable_requested()):
        level = "portable"
    elif level is None:
        level, why = chosen_level()
        if level is None and platform.machine() in X86:
            raise RuntimeError(why)
    if level is not None and sanitizer() is None:
        found = prebuilt.prebuilt_library(level, prebuilt.sources_digest(SOURCES, HEADER))
        if found is not None:
            return found
    return compile_level(level)


def compile_level(level: str | None) -> Path:
    """Compile `level` (None: this machine's native build) into the cache, or return the cached library."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (gcc or cc on PATH, or $CC)")
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"C compiler {cc} does not run: {exc}") from exc
    args = flags(False, sanitizer(), level)
    digest = hashlib.sha256()
    for part in [*(HERE / s for s in SOURCES), HERE / HEADER]:
        digest.update(part.read_bytes())
    digest.update(version.encode())
    native = "" if level is not None else _cpu_features()  # a level's code runs on every CPU that has the level
    digest.update(" ".join([cc, *args, platform.machine(), native]).encode())
    target = cache_root() / digest.hexdigest()[:20] / f"libkubeinfer_cpu_{level or 'native'}.so"
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


def prebuild(where: Path | None = None, levels: list[str] | None = None) -> list[Path]:
    """Compile `levels` (default: every x86-64 level) into `where` (default prebuilt/) with the sources' stamp
    (prebuilt.py); raises RuntimeError when one does not build."""
    where = prebuilt.PREBUILT if where is None else where
    where.mkdir(parents=True, exist_ok=True)
    (where / prebuilt.STAMP).unlink(missing_ok=True)  # stale until every library is in place
    copied = [Path(shutil.copyfile(compile_level(level), where / prebuilt.library_name(level)))
              for level in (list(LEVELS) if levels is None else levels)]
    (where / prebuilt.STAMP).write_text(prebuilt.sources_digest(SOURCES, HEADER) + "\n")
    return copied


def load(portable: bool | None = None, level: str | None = None) -> tuple[ctypes.CDLL | None, str]:
    """(the library, "") or (None, why not)."""
    try:
        return ctypes.CDLL(str(build(portable, level))), ""
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        return None, str(exc)


def loaded_level(lib: ctypes.CDLL) -> str:
    """The level a loaded library was built for (its file's name: libkubeinfer_cpu_<level>.so)."""
    return Path(lib._name).stem.removeprefix("libkubeinfer_cpu_")


if __name__ == "__main__":  # `make setup` builds it ahead of first use; `--all` builds every level (x86: compiling
    import sys               # a level needs no CPU that runs it)
    if "--prebuild" in sys.argv[1:]:
        if platform.machine() not in X86:
            sys.exit(f"prebuilt levels are x86-64 builds; this machine is {platform.machine()} (its one native build "
                     "is compiled at first use)")
        for path in prebuild():
            print(f"prebuilt {path}")
    elif "--all" in sys.argv[1:]:
        for lvl in list(LEVELS) if platform.machine() in X86 else [None]:
            lib, why = load(level=lvl)
            print(f"cpu_native kernels {lvl or 'native'}: {'built ' + lib._name if lib else 'not built: ' + why}")
    else:
        lib, why = load()
        print(f"cpu_native kernels: {'built ' + loaded_level(lib) if lib else 'not built: ' + why}"
              + (f" (VNNI: {bool(lib.ki_has_vnni())})" if lib else ""))
