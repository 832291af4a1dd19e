"""The `kubeinfer` command: one entry point, a subcommand per component."""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Callable

# OpenBLAS reads this once, when numpy loads it (every subcommand imports numpy later, lazily): its idle worker
# then sleeps after ~2**4 cycles instead of spinning ~0.1 s on the core a CPU engine's small steps share
# (platforms/cpu/two_cores.py; float32 decode measured no slower). A value the user set is kept.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")


def _generate(args: argparse.Namespace) -> int:
    from kubeinfer.engine import LLM, SamplingParams

    llm = LLM(model=args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed)
    for output in llm.generate(args.prompt, params):
        print(json.dumps({"prompt": output.prompt, "text": output.outputs[0].text,
                          "finish_reason": output.outputs[0].finish_reason}))
    return 0


def _random_model(args: argparse.Namespace) -> int:
    from kubeinfer.dev.testing.random_model import build_random_model

    overrides = dict(hidden_size=args.hidden_size, num_layers=args.num_layers, num_heads=args.num_heads,
                     num_kv_heads=args.num_kv_heads, intermediate_size=args.intermediate_size)
    path = build_random_model(args.out, args.family, **{k: v for k, v in overrides.items() if v is not None})
    print(path)
    return 0


def _models(args: argparse.Namespace) -> int:
    from kubeinfer.engine.model_executor.models.registry import feature_table, markdown_table

    if args.format == "json":
        print(json.dumps(feature_table(), indent=2))
    elif args.format == "markdown":
        print(markdown_table())
    else:
        rows = feature_table()
        widths = {h: max(len(h), *(len(r[h]) for r in rows)) for h in rows[0]}
        for row in [{h: h for h in rows[0]}, *rows]:
            print("  ".join(row[h].ljust(widths[h]) for h in widths).rstrip())
    return 0


def _models_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--format", choices=["table", "json", "markdown"], default="table")


def _serve(args: argparse.Namespace) -> int:
    from kubeinfer.engine.entrypoints.serve import main as serve_main
    return serve_main(args)


def _generate_arguments(gen: argparse.ArgumentParser) -> None:
    gen.add_argument("model")
    gen.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--device", default="cpu")
    gen.add_argument("--dtype", default=None)
    gen.add_argument("--max-model-len", type=int, default=None)


def _random_model_arguments(rnd: argparse.ArgumentParser) -> None:
    rnd.add_argument("out")
    from kubeinfer.dev.testing.random_model import ALL_FAMILIES
    rnd.add_argument("--family", default="llama", choices=list(ALL_FAMILIES))
    for name in ("hidden-size", "num-layers", "num-heads", "num-kv-heads", "intermediate-size"):
        rnd.add_argument(f"--{name}", type=int, default=None)


def _serve_arguments(parser: argparse.ArgumentParser) -> None:
    from kubeinfer.engine.entrypoints.serve import add_serve_arguments
    add_serve_arguments(parser)


def _module(name: str) -> Callable[[], tuple[Callable, Callable]]:
    """A component module exposing `add_arguments(parser)` and `run(args) -> int`, imported only when its
    subcommand runs: the operator's image has no torch, the engine's no kopf."""
    def load() -> tuple[Callable, Callable]:
        module = importlib.import_module(name)
        return module.add_arguments, module.run
    return load


# name -> (help, loader of (add_arguments, run))
SUBCOMMANDS: dict[str, tuple[str, Callable[[], tuple[Callable, Callable]]]] = {
    "serve": ("OpenAI-compatible engine server (HTTP + optional gRPC)", lambda: (_serve_arguments, _serve)),
    "gateway": ("endpoint picker: Envoy ext_proc server and OpenAI-compatible proxy", _module("kubeinfer.gateway.cli")),
    "operator": ("InferenceModel operator (kopf)", _module("kubeinfer.operator.cli")),
    # Dev tools (kubeinfer.dev, loaded only when chosen): local-stack, demo-model and random-model.
    "local-stack": ("the whole stack on this machine on the demo model (make run)",
                    _module("kubeinfer.dev.local_stack")),
    "demo-model": ("train the tiny demo model and its two LoRA adapters", _module("kubeinfer.dev.demo_model")),
    "generate": ("generate offline from a local Hugging Face model directory",
                 lambda: (_generate_arguments, _generate)),
    "models": ("list the model architectures the engine serves, with the features each supports",
               lambda: (_models_arguments, _models)),
    "random-model": ("write a random-init model + tokenizer (tests, benchmarks)",
                     lambda: (_random_model_arguments, _random_model)),
}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """Only the chosen subcommand's module is imported (all of them when argv is None)."""
    # No abbreviations: `--served-model=x` must not pass for --served-model-name (issue 34, finding 11).
    parser = argparse.ArgumentParser(prog="kubeinfer", description="Kubernetes-native LLM serving", allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = next((a for a in argv if a in SUBCOMMANDS), None) if argv is not None else None
    for name, (help_text, load) in SUBCOMMANDS.items():
        command = sub.add_parser(name, help=help_text, allow_abbrev=False)
        if argv is None or name == chosen:
            add_arguments, run = load()
            add_arguments(command)
            command.set_defaults(func=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
