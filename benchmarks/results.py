"""Keeps benchmarks/RESULTS.md as sections, each rewritten by the benchmark that owns it."""
from __future__ import annotations

import datetime
import re
from pathlib import Path

RESULTS = Path(__file__).parent / "RESULTS.md"
HEADER = "# Benchmark results\n\nEach section is written by the benchmark named in it; rerun the command to refresh it.\n"


def update_results(key: str, title: str, body: str) -> None:
    text = RESULTS.read_text() if RESULTS.exists() else HEADER
    stamp = datetime.date.today().isoformat()
    section = f"<!-- {key} -->\n## {title}\n\n_Measured {stamp}._ {body}\n<!-- /{key} -->"
    pattern = re.compile(rf"<!-- {re.escape(key)} -->.*?<!-- /{re.escape(key)} -->", re.S)
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else text.rstrip() + "\n\n" + section + "\n"
    RESULTS.write_text(text)
    print(f"wrote {RESULTS}")
