"""The `kubeinfer` command: one entry point, a subcommand per component."""
from __future__ import annotations

import argparse
import json
import sys


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
    from kubeinfer.engine.random_model import build_random_model

    overrides = dict(hidden_size=args.hidden_size, num_layers=args.num_layers, num_heads=args.num_heads,
                     num_kv_heads=args.num_kv_heads, intermediate_size=args.intermediate_size)
    path = build_random_model(args.out, args.family, **{k: v for k, v in overrides.items() if v is not None})
    print(path)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from kubeinfer.engine.serve import main as serve_main
    return serve_main(args)


def _not_built(issue: int, what: str):
    def run(_: argparse.Namespace) -> int:
        print(f"kubeinfer: {what} is not built yet (issue #{issue})", file=sys.stderr)
        return 2
    return run


def _component(sub, name: str, help_text: str, module: str) -> None:
    """A subcommand whose module provides `add_arguments(parser)` and `run(args) -> int`."""
    import importlib

    component = importlib.import_module(module)
    parser = sub.add_parser(name, help=help_text, description=(component.__doc__ or "").strip())
    component.add_arguments(parser)
    parser.set_defaults(func=component.run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kubeinfer", description="Kubernetes-native LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate offline from a local Hugging Face model directory")
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
    gen.set_defaults(func=_generate)

    rnd = sub.add_parser("random-model", help="write a random-init model + tokenizer (tests, benchmarks)")
    rnd.add_argument("out")
    rnd.add_argument("--family", default="llama", choices=["llama", "mistral", "qwen2", "qwen3"])
    for name in ("hidden-size", "num-layers", "num-heads", "num-kv-heads", "intermediate-size"):
        rnd.add_argument(f"--{name}", type=int, default=None)
    rnd.set_defaults(func=_random_model)

    srv = sub.add_parser("serve", help="OpenAI-compatible engine server (HTTP + optional gRPC)")
    from kubeinfer.engine.serve import add_serve_arguments
    add_serve_arguments(srv)
    srv.set_defaults(func=_serve)
    _component(sub, "gateway", "endpoint picker: Envoy ext_proc server and OpenAI-compatible proxy",
               "kubeinfer.gateway.cli")
    sub.add_parser("operator", help="InferenceModel operator").set_defaults(func=_not_built(6, "the operator"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
