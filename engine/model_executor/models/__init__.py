"""Model architectures, written for flattened batches over the paged KV cache (Llama and relatives)."""
