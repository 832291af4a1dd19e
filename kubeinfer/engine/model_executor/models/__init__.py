"""Model architectures, written for flattened batches over the paged KV cache: llama.py (Llama, Mistral, Qwen2,
Qwen3, and the base classes), gemma.py, phi3.py, olmo2.py, granite.py; registry.py maps config names to them."""
