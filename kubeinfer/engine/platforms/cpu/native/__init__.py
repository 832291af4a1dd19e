"""Native CPU kernels for quantized linear layers: integer dot products with AVX-512 VNNI (vpdpbusd), as
llama.cpp multiplies its Q8_0 / Q4_0 weights, where torch has nothing fast at both 1 and 16 tokens
(`torch._int_mm` reads int8 weights at a quarter of the memory bandwidth at one token). kernels.c is compiled
at first use with the system C compiler (build.py) and called through ctypes (ops.py), which releases the GIL;
its threads are a persistent pool of its own. Without a compiler the torch kernels run (ops.available()).
attention.c (#included by kernels.c) is the CPU decode attention over the paged KV cache
(platforms/cpu/cpu_attention.py);
decode_ops.c a decode step's norms, activation and rotary (platforms/cpu/cpu_fused_ops.py); decoder_layer.c whole
decoder
layers of a decode step made of those calls, one call for them all (platforms/cpu/cpu_decoder.py,
platforms/cpu/native_decode.py);
w4a8_linear.c the W4A8 product, int4 weights times int8 activations in exact sums per weight group (w4a8_ops.py)."""
