"""The CPU platform: the native C kernels (native/), decode attention over the paged cache (cpu_attention), fused
norms/activation/rotary (cpu_fused_ops), whole decoder layers of a decode step in one call (cpu_decoder,
native_decode), BLAS threading of small steps (cpu_blas), the two cores' split (two_cores) and the native lm_head."""
