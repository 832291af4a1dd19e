"""A request's LoRA adapter, named as in vLLM: `LoRARequest(lora_name, lora_int_id, lora_path)`."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1 (0 is the base model), got {self.lora_int_id}")
