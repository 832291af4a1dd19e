"""vLLM's runtime adapter routes: `POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`.

A path in a request is confined to the server's allowed adapter directories (`--allowed-lora-dirs`)
before anything is read, and the adapter is read and validated off the engine thread; only the
registration itself runs on the engine thread, between two steps, so a bad or slow adapter never
disturbs requests in flight.
"""
from __future__ import annotations

import asyncio

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from ...lora.adapter import LoRALoadError, resolve_adapter_path
from ...lora.request import LoRARequest
from .errors import APIError
from .protocol import LoadLoRARequest, UnloadLoRARequest
from .server_state import ServerState


def add_lora_routes(app: FastAPI, state: ServerState) -> None:
    def lora_enabled() -> None:
        if state.engine.lora is None:
            raise APIError(400, "LoRA is not enabled on this server; start it with --enable-lora", "lora_name")

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(body: LoadLoRARequest):
        lora_enabled()
        name = body.lora_name
        if name == state.served_model_name or state.engine.lora.find(name) is not None:
            raise APIError(400, f"The lora adapter '{name}' has already been loaded.", "lora_name")
        try:
            path = resolve_adapter_path(body.lora_path, state.lora_dirs)
            request = LoRARequest(name, state.new_lora_id(), str(path))
            adapter = await asyncio.to_thread(state.engine.lora.read, request)
            await state.async_engine.call(lambda: state.engine.add_lora(request, adapter))
        except (LoRALoadError, ValueError) as error:
            raise APIError(400, str(error), "lora_path" if isinstance(error, LoRALoadError) else "lora_name") from error
        return f"Success: LoRA adapter '{name}' added successfully."

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(body: UnloadLoRARequest):
        lora_enabled()
        try:
            await state.async_engine.call(lambda: state.engine.remove_lora(body.lora_name))
        except KeyError:
            raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", "lora_name") from None
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
