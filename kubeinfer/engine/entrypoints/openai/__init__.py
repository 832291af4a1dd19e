"""The OpenAI-compatible HTTP API (FastAPI): the app and its routes (api_server), request bodies
(protocol), the completions and chat handlers (serving_completion, serving_chat) over a shared request
life (serving_engine), SSE and usage formatting (streaming), errors in OpenAI's shape (errors), and
vLLM's LoRA adapter routes."""
