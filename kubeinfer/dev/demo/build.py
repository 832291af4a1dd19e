"""The idempotent build of the demo model into OUT: a manifest marks a complete build, a sibling temporary
directory is renamed to OUT at the end; and greedy samples of a finished build."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from kubeinfer.dev.demo.recipe import (ADAPTER_STYLES, DEMO_QUESTIONS, FORMAT_VERSION, MANIFEST, STYLES, DemoModelError,
                                   DemoRecipe)
from kubeinfer.dev.demo.training import _train_all
from kubeinfer.dev.file_modes import share_readable


# -- the build ----------------------------------------------------------------------------------------------
def read_manifest(out: Path) -> dict | None:
    """The manifest of a complete build in `out`, or None if `out` holds no complete build."""
    try:
        manifest = json.loads((out / MANIFEST).read_text())
        files = manifest["files"]
        complete = manifest["format"] == FORMAT_VERSION and all(
            (out / name).is_file() and (out / name).stat().st_size == size for name, size in files.items())
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return manifest if complete else None


def _check_replaceable(out: Path) -> None:
    """Refuse to delete anything that is not a (partial) demo model: OUT may be a typo for a real folder."""
    if not out.exists():
        return
    if not out.is_dir():
        raise DemoModelError(f"{out} exists and is not a directory; choose another OUT")
    ours = {"base", "adapters", "draft", MANIFEST}
    strangers = sorted(p.name for p in out.iterdir() if p.name not in ours)
    if strangers:
        raise DemoModelError(f"{out} exists and holds files that are not a demo model ({', '.join(strangers[:5])}); "
                             "choose another OUT or remove that directory yourself")


@contextmanager
def _free_cores():
    """Train on the cores nobody else is using: an OpenMP thread that waits for a busy core stalls every
    step, and on a shared 2-core machine that made training four times slower, not half as fast."""
    import torch

    previous = torch.get_num_threads()
    busy = round(os.getloadavg()[0]) if hasattr(os, "getloadavg") else 0
    torch.set_num_threads(max(1, min(previous, (os.cpu_count() or 1) - busy)))
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def build_demo_model(out: str | Path, *, steps: int | None = None, force: bool = False,
                     recipe: DemoRecipe | None = None, progress: bool = True) -> Path:
    """Build the demo model into `out` and return `out`; idempotent.

    A complete build already in `out` is reused unless `force` is set, or a recipe or step count is given
    that differs from the one it was built with. A partial or stale one is replaced.
    """
    out = Path(out).expanduser().absolute()
    wanted = recipe or DemoRecipe()
    if steps is not None:
        wanted = wanted.with_steps(steps)
    existing = read_manifest(out)
    if existing and not force and (existing["recipe"] == asdict(wanted) or (recipe is None and steps is None)):
        return out
    _check_replaceable(out)
    out.parent.mkdir(parents=True, exist_ok=True)

    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        with _free_cores():
            losses = _train_all(work, out, wanted, progress)
        files = {str(p.relative_to(work)): p.stat().st_size for p in sorted(work.rglob("*")) if p.is_file()}
        manifest = {"format": FORMAT_VERSION, "recipe": asdict(wanted), "styles": list(STYLES),
                    "adapters": list(ADAPTER_STYLES), "draft": "draft", "final_losses": {k: round(v, 3) for k, v in losses.items()},
                    "train_seconds": round(time.perf_counter() - started, 1), "files": files}
        (work / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")  # last: it marks completeness
        share_readable(work)  # an engine of another uid reads it through a volume
        if out.exists():
            old = out.with_name(f".{out.name}.old-{work.name}")
            out.rename(old)
            work.rename(out)
            shutil.rmtree(old)
        else:
            work.rename(out)
    finally:
        if work.exists():
            shutil.rmtree(work)
    return out


def greedy_samples(out: Path, questions: tuple[str, ...] = DEMO_QUESTIONS,
                   max_tokens: int = 40) -> dict[str, list[str]]:
    """Greedy chat answers of our engine to `questions`: "base" and each adapter -> one answer per question."""
    from kubeinfer.engine import LLM, LoRARequest, SamplingParams

    manifest = read_manifest(out)
    if manifest is None:
        raise DemoModelError(f"{out} holds no complete demo model; run `kubeinfer demo-model {out}`")
    llm = LLM(str(out / "base"), enable_lora=True, max_lora_rank=manifest["recipe"]["lora_rank"], num_kv_blocks=256)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    conversations = [[{"role": "user", "content": question}] for question in questions]
    samples = {"base": [o.outputs[0].text for o in llm.chat(conversations, params)]}
    for lora_id, name in enumerate(manifest["adapters"], start=1):
        lora = LoRARequest(name, lora_id, str(out / "adapters" / name))
        samples[name] = [o.outputs[0].text for o in llm.chat(conversations, params, lora_request=lora)]
    return samples
