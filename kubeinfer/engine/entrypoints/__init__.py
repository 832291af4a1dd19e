"""How users reach the engine: the offline `LLM`, the `kubeinfer serve` process with its OpenAI-compatible
HTTP API (`openai/`) and gRPC API (`grpc/`), and the Prometheus metrics they export. The top layer:
nothing else in the engine imports it."""
