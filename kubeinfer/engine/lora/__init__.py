"""Multi-LoRA: adapters in PEFT format served side by side in one batch.

`request` names an adapter (LoRARequest); `adapter` reads and validates its files; `pool` keeps adapters
in device slots (and a host cache); `manager` registers them by name; `layers` applies each token's
adapter delta inside the model's projections, with Triton kernels (`triton_ops`) on the GPU path;
`placement` applies the operator's per-pod adapter assignment while serving. Imports only the engine's
shared modules (config, triton_utils), so the model executor and the core can both build on it.
"""
