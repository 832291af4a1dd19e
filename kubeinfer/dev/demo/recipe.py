"""What every part of the demo build shares: the layout constants, the recipe that decides the weights,
and the error raised when the demo model cannot be built."""
from __future__ import annotations

from dataclasses import dataclass, replace

MANIFEST = "demo-model.json"
FORMAT_VERSION = 2  # 2: a draft model for speculative decoding. Bump when the training recipe or layout changes: older builds are then rebuilt
STYLES = ("docs", "legal", "python")
ADAPTER_STYLES = ("legal", "python")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Chat messages that ask for no style in particular: the answer's style comes from the adapter.
DEMO_QUESTIONS = ("Hello!", "Tell me something.", "What is this about?", "Write a few lines.")


class DemoModelError(RuntimeError):
    """The demo model cannot be built where asked; the message says what to do."""


@dataclass(frozen=True)
class DemoRecipe:
    """Everything that decides the weights; stored in the manifest so a changed recipe is rebuilt."""
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 384
    vocab_size: int = 1024
    max_position_embeddings: int = 1024
    context: int = 128  # training window, in tokens
    batch_size: int = 8
    base_steps: int = 480
    adapter_steps: int = 160
    base_lr: float = 5e-3
    adapter_lr: float = 1e-2
    lora_rank: int = 16
    lora_alpha: float = 32.0
    chat_fraction: float = 0.4
    max_chars_per_style: int = 150_000  # a corpus small enough to be seen a few times: its phrases stick
    # The draft model (speculative decoding): one thin layer, distilled from the base on the same windows.
    draft_hidden_size: int = 64
    draft_num_layers: int = 1
    draft_num_heads: int = 2  # the base's head size (32)
    draft_num_kv_heads: int = 1
    draft_intermediate_size: int = 192
    draft_steps: int = 480
    draft_lr: float = 1e-2
    seed: int = 0

    def with_steps(self, steps: int) -> "DemoRecipe":
        """`--steps N`: N base steps and N draft steps; each adapter gets a third of that."""
        if steps < 1:
            raise ValueError(f"--steps must be at least 1, got {steps}")
        return replace(self, base_steps=steps, adapter_steps=max(1, steps // 3), draft_steps=steps)
