"""Mixture-of-experts layers: the router's top-k choice (router.py), the experts of one layer stacked in two
tensors and run grouped by expert (layer.py; grouped.py on the CPU, triton_moe.py's fused kernels on a GPU)."""
