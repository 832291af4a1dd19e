"""The model's building blocks: attention over the paged KV cache (a torch backend for any device, a
Triton one for GPUs, and the selector between them), rotary embeddings, RMSNorm, and fused kernels."""
