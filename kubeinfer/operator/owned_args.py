"""What spec.engine.args and spec.engine.env may not touch: the flags and variables the operator sets.

The engine parses its flags with argparse. An argparse parser that allows abbreviations (the default,
and what engine images built before `allow_abbrev=False` still do) reads `--served-model=x` or `--ho`
as `--served-model-name` and `--host`, so comparing whole flag names is not enough: any option that
is a prefix of an operator-owned flag is refused, with or without `=VALUE`.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from kubeinfer.common import envs
from kubeinfer.common.engine_key import ENGINE_KEY_ENVS

# Every flag pod_template.engine_args may set, and the engine's key (its env var is the operator's).
OWNED_FLAGS = ("--host", "--port", "--grpc-port", "--served-model-name", "--lora-catalog-dir",
               "--lora-placement-file", "--lora-modules", "--enable-lora", "--max-loras", "--max-lora-rank",
               "--device", "--dtype", "--max-model-len", "--scheduling-policy", "--api-key",
               # spec.engine.parallelism: the ranks must agree with the GPUs and pods the operator asks for
               "--tensor-parallel-size", "--nnodes", "--node-rank", "--master-addr", "--master-port", "--headless",
               # spec.routing.kvEvents: the ports must be the ones the NetworkPolicy opens and the gateway dials
               "--kv-events-config")
# Single-dash spellings of owned flags (vLLM's `-tp N`, `-tp=N`, `-tpN`).
OWNED_SHORT = {"-tp": "--tensor-parallel-size"}
# The engine reads its key from these; the operator sets KUBEINFER_API_KEY from its Secret.
OWNED_ENV = ENGINE_KEY_ENVS


def option_of(arg: str) -> str | None:
    """The option an argument names (`--ho=x` -> `--ho`, `-tp4` -> `-tp`), or None for a value or a positional."""
    short = next((s for s in OWNED_SHORT if arg.startswith(s)), None)
    if short is not None:
        return short
    if not arg.startswith("--") or arg == "--":
        return None
    return arg.split("=", 1)[0]


def owned_flag(option: str, owned: Iterable[str] = OWNED_FLAGS) -> str | None:
    """The owned flag `option` spells, in full or abbreviated (a prefix argparse would expand), or None."""
    if option in OWNED_SHORT:
        return OWNED_SHORT[option]
    return next((flag for flag in owned if flag.startswith(option) and len(option) > 2), None)


def args_problems(args: Sequence[str]) -> list[str]:
    problems = []
    for i, arg in enumerate(args):
        option = option_of(arg)
        flag = owned_flag(option) if option else None
        if flag is None:
            continue
        spelt = "" if option == flag else f" (as {option!r}: argparse expands unambiguous prefixes)"
        problems.append(f"spec.engine.args[{i}] must not set {flag}{spelt}: the operator sets it from the spec "
                        "(use spec.model, spec.engine.maxModelLen / dtype / resources / parallelism, spec.adapterPool "
                        "or spec.routing.kvEvents)")
    return problems


# The operator sets it on every pod of a multi-node model from the model's Secret (group_secret.py).
TP_SECRET_ENV = envs.TP_SECRET.name


def env_problems(env: Sequence[dict[str, Any]]) -> list[str]:
    problems = []
    for i, item in enumerate(env):
        name = item.get("name") if isinstance(item, dict) else None
        if name in OWNED_ENV:
            problems.append(f"spec.engine.env[{i}].name {name!r} is the engine's API key: the operator sets it "
                            "from the key the gateway presents (--engine-api-key-secret)")
        elif name == TP_SECRET_ENV:
            problems.append(f"spec.engine.env[{i}].name {name!r} is the tensor-parallel group's secret: the "
                            "operator sets it from the Secret NAME-tp-secret it creates (a Secret of that name "
                            "made beforehand is kept)")
    return problems
