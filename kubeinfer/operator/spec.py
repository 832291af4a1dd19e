"""The operator's reading of an InferenceModel spec: the shared typed model (kubeinfer.common.inference_model)
with its sources read into the operator's Source and the checks only the operator knows (the flags and
variables it sets), refused as a whole when anything is wrong.

Everything wrong is reported at once in one SpecError, each problem naming its field. spec.routing is mostly
the gateway's business (it reads the same model from the InferenceModel itself), except routing.kvEvents,
which makes the engines publish the KV-cache events the gateway's precise prefix routing follows.
"""
from __future__ import annotations

from typing import Any

from kubeinfer.common.inference_model import (Adapter, AdapterPool, Autoscaling, EngineSpec, InferenceModel,
                                              Parallelism, Resources, read_spec)
from kubeinfer.operator.owned_args import args_problems, env_problems
from kubeinfer.operator.sources import Source, parse_source

InferenceModelSpec = InferenceModel[Source]  # the one model, its sources read by sources.parse_source

__all__ = ["Adapter", "AdapterPool", "Autoscaling", "EngineSpec", "InferenceModelSpec", "Parallelism", "Resources",
           "SpecError", "parse_spec"]


class SpecError(ValueError):
    """The spec cannot be served as written; the message lists every problem and its field."""

    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems))
        self.problems = problems


def _owned(args: tuple[str, ...], env: tuple[dict[str, Any], ...]) -> list[str]:
    return args_problems(args) + env_problems(env)


def parse_spec(name: str, spec: dict[str, Any]) -> InferenceModelSpec:
    """The typed spec of InferenceModel `name`, or SpecError listing every problem."""
    model, problems = read_spec(name, spec, source=parse_source, engine_checks=_owned)
    if problems or model.model is None:
        raise SpecError(problems or ["spec.model.uri is required"])
    return model
