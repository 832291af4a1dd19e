"""Configuration every layer reads: the user's knobs (EngineConfig) and the checkpoint's architecture
(ModelSpec), as vLLM keeps its configs in one place below the engine's layers. No torch here."""
from __future__ import annotations

import copy
import importlib.util
import json
from dataclasses import dataclass, field

from .kernel_config import KernelConfig, variable_default

KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")  # vLLM's CacheDType spellings
# KV cache memory when the user gives no block count and the device is a CPU (vLLM's CPU default is 4 GiB).
DEFAULT_CPU_KV_CACHE_BYTES = 4 << 30


def json_object_flag(value: str | dict | None, flag: str) -> dict | None:
    """A flag that takes a JSON object (vLLM's --kv-events-config, --kv-transfer-config): the object from a JSON
    string or a dict, None when absent; ValueError naming the flag when it is not valid JSON or not an object."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"{flag} is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object")
    return value


@dataclass
class EngineConfig:
    model: str
    device: str = "cpu"
    dtype: str | None = None
    quantization: str | None = None  # vLLM's --quantization: must name the checkpoint's quantization_config method
    kv_cache_dtype: str = "auto"  # vLLM's --kv-cache-dtype: auto (the model dtype), bfloat16 or 8-bit
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int = DEFAULT_CPU_KV_CACHE_BYTES  # the CPU's KV budget; on CUDA see gpu_memory_utilization
    gpu_memory_utilization: float = 0.9  # this engine's share of GPU memory: weights, activations and KV cache
    enforce_eager: bool = False  # no CUDA graphs for decode steps
    enable_prefix_caching: bool = True
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 64
    max_cpu_loras: int | None = None
    scheduling_policy: str = "fcfs"  # "fcfs" (arrival order) or "priority" (lower priority value first)
    attention_backend: str | None = None  # "torch" | "triton"; default: triton on CUDA (when installed), else torch
    seed: int = 0
    tokenizer: str | None = None  # defaults to the model directory
    # vLLM's --speculative-config: a JSON string or dict, e.g. {"method": "ngram", "num_speculative_tokens": 4}
    # or {"model": DRAFT_DIR, "num_speculative_tokens": 4};
    # parsed and checked by spec_decode.config (the engine refuses a bad one before loading the model)
    speculative_config: str | dict | None = None
    # Detokenizing and output delivery of step N while the device computes step N+1 (deferred text,
    # core/output_processor.py). None: on with CUDA; on a CPU nothing runs alongside the forward, so it would only delay outputs.
    async_output_processing: bool | None = None
    # vLLM's --kv-events-config: a JSON string or dict, e.g. {"enable_kv_cache_events": true, "publisher": "zmq",
    # "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}; parsed by core/kv_event_publisher.py
    kv_events_config: str | dict | None = None
    # The API key the KV-event sockets are CURVE-authenticated with (serve: --api-key, unless --kv-events-auth
    # none); None: vLLM's unauthenticated sockets. Not one of vLLM's keys: kubeinfer/common/kv_events_curve.py.
    kv_events_key: str | None = field(default=None, repr=False)
    # Schedule and launch step N+1 before step N's ids reach the host (core/async_scheduling.py). For a GPU;
    # off by default, as in vLLM (`--async-scheduling`). On a CPU it only delays outputs by a step.
    async_scheduling: bool = False

    # Tensor parallelism (kubeinfer/engine/distributed/): ranks in the whole group, as in vLLM; split evenly over
    # nnodes.
    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0  # this node's place; node 0 runs the scheduler, the others follow it (--headless)
    master_addr: str = "127.0.0.1"  # node 0's address, where the group meets
    master_port: int | None = None  # None: a free port (one node only)
    distributed_timeout: float = 60.0  # seconds a rank may stay silent in a step before the engine dies
    # Which kernels the layers use (`kernels`, kernel_config.KernelConfig says what each means): the KUBEINFER_*
    # variables fill these defaults when this config is built, and the layers read the engine's, not the variables
    quant_kernel: str | None = field(default_factory=variable_default("quant_kernel"))  # KUBEINFER_QUANT_KERNEL
    w8a8_kernel: str = field(default_factory=variable_default("w8a8_kernel"))  # KUBEINFER_W8A8_KERNEL
    cpu_native_layers: bool = field(default_factory=variable_default("cpu_native_layers"))
    cpu_fused_layers: bool = field(default_factory=variable_default("cpu_fused_layers"))
    cpu_share_cores: str = field(default_factory=variable_default("cpu_share_cores"))
    cpu_openblas: bool = field(default_factory=variable_default("cpu_openblas"))

    # KV-cache tiering (kubeinfer/engine/kv_transfer/), vLLM's flags: --kv-transfer-config JSON (kv_connector,
    # kv_role, kv_connector_extra_config, kv_load_failure_policy), or its shorthand --kv-offloading-size GiB with
    # --kv-offloading-backend native. Parsed, and a bad one refused, before the model loads.
    kv_transfer_config: str | dict | None = None
    kv_offloading_size: float | None = None
    kv_offloading_backend: str | None = None

    def __post_init__(self) -> None:
        self.kernels  # noqa: B018  (checks the kernel fields)

        def positive(name: str) -> None:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size", "num_kv_blocks",
                     "max_loras", "max_lora_rank", "tensor_parallel_size", "nnodes"):
            positive(name)
        if not isinstance(self.node_rank, int) or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes={self.nnodes}), got {self.node_rank!r}")
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size} is the whole group's ranks and must "
                             f"divide evenly over nnodes {self.nnodes} (each node runs the same number of ranks)")
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("nnodes > 1 needs master_addr and master_port (--master-addr, --master-port): "
                             "where the nodes meet")
        if not isinstance(self.distributed_timeout, (int, float)) or self.distributed_timeout <= 0:
            raise ValueError("distributed_timeout must be a positive number of seconds, "
                             f"got {self.distributed_timeout!r}")
        if not isinstance(self.gpu_memory_utilization, (int, float)) or not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be a fraction in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {self.kv_cache_dtype!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.world_size > 1 and self.async_scheduling:
            raise ValueError("async_scheduling is not supported with tensor parallelism yet; drop --async-scheduling")
        if self.world_size > 1 and self.speculative_config:
            raise ValueError("speculative decoding is not supported with tensor parallelism yet; "
                             "drop --speculative-config or use --tensor-parallel-size 1")
        if self.attention_backend is None:
            on_gpu = self.device.startswith("cuda") and importlib.util.find_spec("triton") is not None
            self.attention_backend = "triton" if on_gpu else "torch"


    @property
    def kernels(self) -> KernelConfig:
        """A new KernelConfig of this config's kernel fields (each ModelRunner holds its own)."""
        return KernelConfig(**{name: getattr(self, name) for name in KernelConfig.field_names()})

    @property
    def world_size(self) -> int:
        """Ranks in the tensor-parallel group, over all nodes (vLLM's `--tensor-parallel-size`)."""
        return self.tensor_parallel_size

    @property
    def ranks_per_node(self) -> int:
        """Ranks (processes, one GPU each on CUDA) on each node of the group."""
        return self.tensor_parallel_size // self.nnodes


@dataclass(frozen=True)
class Part:
    """One part of a projection split across tensor-parallel ranks: its size in the checkpoint, and the run
    of it (start, size) this rank holds."""
    total: int
    start: int
    size: int


ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh")  # hidden_act values the models implement


class ModelSpec:
    """The architectural switches of one checkpoint, resolved from its HF config. Switches only one family
    reads stay in `config`, which its model module reads itself."""

    def __init__(self, config, architecture: str) -> None:
        self.config, self.architecture = config, architecture
        self.hidden_size = config.hidden_size
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or self.hidden_size // self.num_heads
        self.intermediate_size = config.intermediate_size
        self.vocab_size = config.vocab_size
        self.rms_norm_eps = config.rms_norm_eps
        self.max_position_embeddings = config.max_position_embeddings
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.qkv_bias = architecture == "Qwen2ForCausalLM" or bool(getattr(config, "attention_bias", False))
        if architecture == "Qwen2MoeForCausalLM":  # Qwen2-MoE names its q/k/v biases qkv_bias
            self.qkv_bias = bool(getattr(config, "qkv_bias", True))
        self.o_bias = architecture != "Qwen2ForCausalLM" and bool(getattr(config, "attention_bias", False))
        self.mlp_bias = bool(getattr(config, "mlp_bias", False))
        self.qk_norm = architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
        self.moe = None  # the MoE families' MoESettings (models/moe.py), set by their model class
        self.is_moe = architecture in MOE_ARCHITECTURES  # LoRA then targets the attention projections only
        # q/k/v and gate/up already fused in the checkpoint (Phi-3): loaded, and adapted by LoRA, as they are
        self.fused_checkpoint = architecture in FUSED_CHECKPOINT_ARCHITECTURES
        # Each layer's window (None: full attention); `sliding_window` is the window when all layers share one.
        self.layer_windows = _layer_windows(config, architecture)
        shared = set(self.layer_windows)
        self.sliding_window = shared.pop() if len(shared) == 1 else None
        self.rope_theta, self.rope_scaling = rope_settings(config)
        # Gemma spells it hidden_activation
        self.hidden_act = getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None) or "silu"
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {self.hidden_act!r}; supported: {sorted(ACTIVATIONS)}")
        # Tensor parallelism (for_rank): this rank's share; the totals stay on the model-wide spec.
        self.tp_rank, self.tp_size = 0, 1
        self.total_heads, self.total_kv_heads = self.num_heads, self.num_kv_heads
        self.total_intermediate_size = self.intermediate_size

    def for_rank(self, rank: int, size: int) -> ModelSpec:
        """The spec of one rank's slice of the model: its attention heads, KV heads (one each, replicated,
        when there are fewer KV heads than ranks) and MLP columns (every expert's, in an MoE model: the
        experts read their totals from the config). Refuses sizes that do not divide."""
        if size == 1:
            return self
        def share(total: int, what: str) -> int:
            if total % size:
                raise ValueError(f"the model's {what} ({total}) is not divisible by the tensor parallel size "
                                 f"({size}); choose a --tensor-parallel-size that divides {total}")
            return total // size
        local = copy.copy(self)
        local.tp_rank, local.tp_size = rank, size
        local.num_heads = share(self.num_heads, "number of attention heads")
        if self.num_kv_heads >= size:
            local.num_kv_heads = share(self.num_kv_heads, "number of KV heads")
        elif size % self.num_kv_heads:
            raise ValueError(f"the model's number of KV heads ({self.num_kv_heads}) neither divides nor is divisible "
                             f"by the tensor parallel size ({size}); choose a size that {self.num_kv_heads} divides")
        else:
            local.num_kv_heads = 1
        local.intermediate_size = share(self.intermediate_size, "intermediate_size")
        for field in ("moe_intermediate_size", "shared_expert_intermediate_size"):  # each expert's columns split too
            if getattr(self.config, field, None):
                share(getattr(self.config, field), field)
        return local

    def qkv_parts(self) -> list[Part]:
        """q, k and v of this rank: its query heads, and its KV heads (the one it shares, when replicated)."""
        d = self.head_dim
        kv = Part(self.total_kv_heads * d, self.kv_head_start() * d, self.num_kv_heads * d)
        return [Part(self.total_heads * d, self.tp_rank * self.num_heads * d, self.num_heads * d), kv, kv]

    def gate_up_parts(self) -> list[Part]:
        """gate and up of this rank: its columns of each (down_proj takes the same as its input)."""
        part = Part(self.total_intermediate_size, self.tp_rank * self.intermediate_size, self.intermediate_size)
        return [part, part]

    def kv_head_start(self) -> int:
        """The first of this rank's KV heads in the checkpoint's order (a replicated head: the one it shares)."""
        if self.total_kv_heads >= self.tp_size:
            return self.tp_rank * self.num_kv_heads
        return self.tp_rank * self.total_kv_heads // self.tp_size


def _layer_windows(config, architecture: str) -> list[int | None]:
    """Per layer: the sliding window, or None for full attention. With `layer_types` (Gemma 2 and 3; Qwen2 and
    Qwen3 with use_sliding_window, from max_window_layers up) only the "sliding_attention" layers are windowed;
    without, every layer is when the config has a window (Mistral, Phi-3)."""
    num_layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if architecture in QWEN_ARCHITECTURES and not getattr(config, "use_sliding_window", False):
        window = None  # Qwen configs carry a window they do not use
    if not window:
        return [None] * num_layers
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return [int(window) if t == "sliding_attention" else None for t in layer_types]
    return [int(window)] * num_layers


def rope_settings(config) -> tuple[float, dict]:
    """(theta, scaling dict) from a config, in either transformers 5 (`rope_parameters`) or 4
    (`rope_theta` + `rope_scaling`) spelling."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy = dict(getattr(config, "rope_scaling", None) or {})
    merged = {**legacy, **params}
    theta = merged.pop("rope_theta", None) or getattr(config, "rope_theta", None) or 10000.0
    if "type" in merged and "rope_type" not in merged:
        merged["rope_type"] = merged.pop("type")
    return float(theta), merged


MOE_ARCHITECTURES = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM", "GptOssForCausalLM")
QWEN_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")

# Architectures whose checkpoints hold qkv_proj and gate_up_proj themselves (PEFT adapters target those too).
FUSED_CHECKPOINT_ARCHITECTURES = ("Phi3ForCausalLM",)

# Checkpoint names that load into a slice of one of our fused parameters: (ours, theirs, slice index).
FUSED_WEIGHTS = (
    ("qkv_proj", "q_proj", 0), ("qkv_proj", "k_proj", 1), ("qkv_proj", "v_proj", 2),
    ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1),
)
