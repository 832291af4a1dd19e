"""The native library's one header (platforms/cpu/native/kubeinfer_cpu.h) and its one bindings module (bindings.py)
declare the same functions with the same number of arguments, every C source includes the header, and the
compiler finds no exported function without a declaration there."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from kubeinfer.engine.platforms.cpu.native import bindings, build

NATIVE = Path(build.__file__).parent
HEADER = NATIVE / build.HEADER
DECLARATION = re.compile(r"^(?:int|long|void|size_t)\s+\**(ki_\w+)\(([^)]*)\);", re.M | re.S)


def header_functions(text: str) -> dict[str, int]:
    """{name: number of arguments} of the ki_* functions a header declares."""
    found = {}
    for name, args in DECLARATION.findall(text):
        args = " ".join(args.split())
        found[name] = 0 if args in ("", "void") else args.count(",") + 1
    return found


def test_the_parser_reads_declarations_over_several_lines():
    text = "int ki_a(void);\nvoid ki_b(const float *x, long n,\n          int k);\nsize_t ki_c(const ki_layer *L);\n"
    assert header_functions(text) == {"ki_a": 0, "ki_b": 3, "ki_c": 1}


def test_bindings_declare_exactly_the_header_functions_with_their_argument_counts():
    in_header = header_functions(HEADER.read_text())
    in_bindings = {name: len(argtypes) for name, (argtypes, _) in bindings.SIGNATURES.items()}
    assert in_header, "no ki_* declaration found in the header"
    assert in_bindings == in_header


def test_the_bounds_status_is_one_constant():
    match = re.search(r"#define KI_EBOUNDS \((-?\d+)\)", HEADER.read_text())
    assert match and int(match.group(1)) == bindings.EBOUNDS
    assert not [s for s in build.SOURCES if "#define KI_EBOUNDS" in (NATIVE / s).read_text()]


@pytest.mark.parametrize("source", sorted(p.name for p in NATIVE.glob("*.c")))
def test_every_source_includes_the_header(source: str):
    assert source in build.SOURCES
    assert f'#include "{build.HEADER}"' in (NATIVE / source).read_text()


def test_every_exported_definition_has_its_declaration():
    cc = build.compiler()
    if cc is None:
        pytest.skip("no C compiler")
    done = subprocess.run([cc, "-fsyntax-only", "-std=gnu11", "-DKI_PORTABLE", "-Werror=missing-prototypes",
                           str(NATIVE / build.SOURCES[0])], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
