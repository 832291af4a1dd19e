"""Endpoint picker: routes each request to the engine pod that serves it best (queue depth, KV cache, LoRA
placement, prefix affinity), as an Envoy ext_proc server or a standalone OpenAI-compatible proxy."""
