"""Every condition reason the operator writes is explained in docs/operator.md (issue #46, defect 9: the docs
left out ContainerNotStarting)."""
from __future__ import annotations

import re
from pathlib import Path

from kubeinfer.operator import errors, status

DOCS = Path(__file__).parents[2] / "docs" / "operator.md"


def written_reasons() -> set[str]:
    source = Path(status.__file__).read_text()
    found = set(re.findall(r'Condition\("\w+", [^,]+, "(\w+)"', source))  # Condition(type, status, reason, ...)
    for first, second in re.findall(r'reason = "(\w+)"(?: if .*? else "(\w+)")?', source):  # the pod reasons
        found |= {first, second} - {""}
    return found | {errors.FORBIDDEN, errors.INVALID, errors.RETRYING, errors.TERMINATING}


def test_the_reasons_are_found_in_the_source():
    assert {"ContainerNotStarting", "EngineCrashLoop", "ImagePullFailed", "NoGPUCapacity", "Unschedulable",
            "ModelLoading", "StandbyUnavailable", "NamespaceTerminating"} <= written_reasons()


def test_every_reason_is_documented():
    text = DOCS.read_text()
    missing = sorted(r for r in written_reasons() if f"`{r}`" not in text)
    assert not missing, f"docs/operator.md does not explain: {missing}"
