"""The native CPU kernels build wherever there is a C compiler. Their tests skip without the library, so a source
that stops compiling (e.g. two included files defining the same helper) would otherwise pass as 'no compiler'."""
from __future__ import annotations

import pytest

from kubeinfer.engine.platforms.cpu.native import build


@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
def test_kernels_build_where_a_compiler_is(portable):
    if build.compiler() is None:
        pytest.skip("no C compiler here: the torch kernels serve")
    lib, why = build.load(portable)
    assert lib is not None, why
