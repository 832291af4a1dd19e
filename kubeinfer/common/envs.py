"""The environment variables the product reads, each declared once (name, meaning, default, what it accepts) and
read through its declaration, so that a bad value is refused with the variable's name and what it takes.

This module holds the mechanism and the variables the parts share (the engine key, read by the engine, passed
on by the operator and presented by the gateway; the tensor-parallel secret, read by the engine and set by the
operator); the engine's own are in kubeinfer/engine/envs.py, which also renders the README's table of both.
Values are read at each call of `get` (tests set them with monkeypatch between calls), never at import here.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


class EnvVarError(ValueError):
    """A variable set to a value its reader does not accept."""


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    """One variable. `parse` turns its text (`default` where unset, and where empty if `empty_is_unset`) into the
    value, raising ValueError for text outside `accepts`; `shown_default` is the default as the README gives it."""

    name: str
    doc: str
    parse: Callable[[str], T]
    default: str = ""
    accepts: str = "any text"
    empty_is_unset: bool = True
    shown_default: str | None = None
    read_by: str = "engine"

    def text(self) -> str:
        value = os.environ.get(self.name)
        if value is None or (value == "" and self.empty_is_unset):
            return self.default
        return value

    def get(self) -> T:
        text = self.text()
        try:
            return self.parse(text)
        except ValueError:
            raise EnvVarError(f"{self.name} must be {self.accepts}; got {text!r}") from None


def text_or_none(text: str) -> str | None:
    return text or None


def one_of(choices: tuple[str, ...], allow_empty: bool = False) -> Callable[[str], str]:
    """A parser that takes `choices` (and "" if `allow_empty`) as they are."""
    def parse(text: str) -> str:
        if text not in choices and not (allow_empty and text == ""):
            raise ValueError(text)
        return text
    return parse


API_KEY: EnvVar[str | None] = EnvVar(
    "KUBEINFER_API_KEY", "the key the engine requires on its API (`kubeinfer serve --api-key`'s default; the "
    "operator sets it from a Secret)", text_or_none, shown_default="unset: the API is open",
    read_by="engine (set by the operator)")
VLLM_API_KEY: EnvVar[str | None] = EnvVar(
    "VLLM_API_KEY", "vLLM's name for KUBEINFER_API_KEY, read where that one is unset (vLLM's manifests carry over)",
    text_or_none, shown_default="unset", read_by="engine")
ENGINE_API_KEY: EnvVar[str | None] = EnvVar(
    "KUBEINFER_ENGINE_API_KEY", "the key the gateway presents to engines (`--engine-api-key`'s default) and the "
    "operator uses for its own reads of engines", text_or_none, shown_default="unset: the client's Authorization",
    read_by="gateway, operator")
TP_SECRET: EnvVar[str] = EnvVar(
    "KUBEINFER_TP_SECRET", "the shared secret (32+ characters) a multi-node tensor-parallel group's ranks "
    "authenticate each other with; the operator sets it from the Secret `NAME-tp-secret`", str,
    shown_default="unset (needed only over several nodes)", read_by="engine (set by the operator)")

SHARED: tuple[EnvVar, ...] = (API_KEY, VLLM_API_KEY, ENGINE_API_KEY, TP_SECRET)
