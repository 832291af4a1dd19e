"""`kubeinfer demo-model OUT`: build (or reuse) the demo model and print how to serve it."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kubeinfer.dev.demo.build import build_demo_model, greedy_samples, read_manifest
from kubeinfer.dev.demo.recipe import DEMO_QUESTIONS, DemoModelError, DemoRecipe


# -- CLI ----------------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", help="directory to write (reused when it already holds a complete build)")
    parser.add_argument("--force", action="store_true", help="rebuild even if OUT holds a complete build")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"base-model training steps (default {DemoRecipe.base_steps}); each adapter gets a third")


def run(args: argparse.Namespace) -> int:
    out = Path(args.out).expanduser().absolute()
    before = read_manifest(out)
    try:
        build_demo_model(out, steps=args.steps, force=args.force)
    except (DemoModelError, ValueError) as error:
        print(f"kubeinfer demo-model: {error}", file=sys.stderr)
        return 2
    manifest = read_manifest(out)
    assert manifest is not None
    if manifest == before:
        print(f"{out}: reusing the demo model built there (pass --force to rebuild)")
    else:
        print(f"{out}: built in {manifest['train_seconds']} s; final training losses {manifest['final_losses']}")
        print(f"  asked {DEMO_QUESTIONS[1]!r}:")
        for name, texts in greedy_samples(out, DEMO_QUESTIONS[1:2]).items():
            print(f"  {name:>7}: {texts[0]!r}")
    adapters = " ".join(f"{name}={out / 'adapters' / name}" for name in manifest["adapters"])
    print(f"serve it: kubeinfer serve {out / 'base'} --served-model-name demo --lora-modules {adapters} "
          f"--max-lora-rank {manifest['recipe']['lora_rank']}")
    print(f"  speculative decoding with its draft: --speculative-config "
          f"'{{\"model\": \"{out / 'draft'}\", \"num_speculative_tokens\": 4}}'")
    return 0
