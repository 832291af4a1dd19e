"""The engine key's environment variables, named once for the three parts that pass it along.

The engine requires the key on its API (`kubeinfer serve --api-key`); the operator sets ENGINE_KEY_ENV in the
engine's pod from a Secret and keeps both names out of `spec.engine.env`; the gateway presents the same key to
engines (`--engine-api-key`), read from GATEWAY_KEY_ENV, a name of its own so that a gateway and an engine in one
environment (the local stack) never mistake one side's setting for the other's. Declared in common/envs.py.
"""
from __future__ import annotations

from kubeinfer.common import envs

ENGINE_KEY_ENV = envs.API_KEY.name
VLLM_KEY_ENV = envs.VLLM_API_KEY.name  # vLLM's name, read too so that its manifests carry over
ENGINE_KEY_ENVS = (ENGINE_KEY_ENV, VLLM_KEY_ENV)  # the engine reads the first one set
GATEWAY_KEY_ENV = envs.ENGINE_API_KEY.name


def engine_key_from_env() -> str | None:
    """The key the engine requires, or None: its API is open."""
    return envs.API_KEY.get() or envs.VLLM_API_KEY.get()


def gateway_key_from_env() -> str | None:
    """The key the gateway presents to engines, or None: it forwards the client's Authorization as sent."""
    return envs.ENGINE_API_KEY.get()
