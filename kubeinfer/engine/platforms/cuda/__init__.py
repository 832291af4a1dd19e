"""The CUDA platform: CUDA graph capture and replay of decode steps (cuda_graphs) and the Triton kernels that
differ by device (triton_attention: paged decode/prefill attention; triton_norm: RMSNorm and rotary)."""
