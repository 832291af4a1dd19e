"""The engine core: requests in, one scheduler step at a time, outputs out.

`LLMEngine` (the synchronous loop) and `AsyncEngine` (that loop on its own thread, for servers) own
the scheduler (continuous batching with chunked prefill and preemption), the block manager (paged KV
blocks, prefix cache), each request's detokenization and stop checks, and KV-cache sizing. They drive
the model executor below; the entrypoints above drive them.
"""
