"""The native CPU library: integer dot products with AVX-512 VNNI (vpdpbusd), as llama.cpp multiplies its Q8_0 /
Q4_0 weights, where torch has nothing fast at both 1 and 16 tokens (`torch._int_mm` reads int8 weights at a
quarter of the memory bandwidth at one token), and the decode step's other ops. kernels.c (with the files it
#includes) is compiled at first use with the system C compiler (build.py) and called through ctypes (ops.py),
which releases the GIL; its threads are a persistent pool of its own. Without a compiler the torch kernels run
(ops.available()). kubeinfer_cpu.h declares every exported function once for C, bindings.py for ctypes.
attention.c is the CPU decode attention over the paged KV cache (../cpu_attention.py); decode_ops.c a decode
step's norms, activation and rotary (../cpu_fused_ops.py); decoder_layer.c whole decoder layers of a decode step
made of those calls, one call for them all (../cpu_decoder.py, ../native_decode.py); w4a8_linear.c the W4A8
product, int4 weights times int8 activations in exact sums per weight group (w4a8_ops.py). The linear methods
that pack weights for these products at load (method.py: NativeIntMethod, a16_method.py: A16Method) live here
beside them: quantization/linear_method.py picks them."""
