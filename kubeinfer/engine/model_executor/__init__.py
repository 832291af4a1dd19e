"""Running the model: weights and KV-cache tensors, one forward pass per step, and sampling.

`ModelRunner` turns a scheduled batch into tensors, runs the model (eagerly, or a captured CUDA graph
for decode steps) and samples each sequence's next token. `model_loader` reads a Hugging Face
checkpoint from safetensors; `models/` holds the architectures, `layers/` their building blocks
(attention backends, rotary embeddings, norms) with their Triton kernels. Below the core; uses lora.
"""
