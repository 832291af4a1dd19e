"""The engine's LoRA adapters, as the front ends and the scheduler see them: register, unregister, list, and
retire the unloaded ones once no request uses them. A part of LLMEngine (its base class), kept apart to
keep llm_engine.py readable; only the engine thread calls it."""
from __future__ import annotations

from ..lora.manager import LoRAManager
from ..lora.request import LoRARequest
from .scheduler import Scheduler


class EngineAdapters:
    lora: LoRAManager | None
    scheduler: Scheduler

    def add_lora(self, lora_request: LoRARequest, adapter=None) -> None:
        """Register an adapter so requests may use it; reads and validates its files unless `adapter`
        (from `self.lora.read`, done off this thread) is given. Raises ValueError / LoRALoadError."""
        if self.lora is None:
            raise ValueError("LoRA is not enabled; create the engine with enable_lora=True (--enable-lora)")
        self.lora.register(lora_request, adapter)

    def remove_lora(self, lora_name: str) -> LoRARequest:
        """Unregister by name; requests in flight on it finish first. KeyError if unknown."""
        request = self.lora.find(lora_name) if self.lora else None
        if request is None:
            raise KeyError(lora_name)
        return self.lora.unregister(request.lora_int_id, self._adapters_in_use())

    def _lora_name(self, lora_id: int) -> str | None:
        request = self.lora.registered.get(lora_id) if self.lora else None
        return request.lora_name if request else None

    def list_loras(self) -> list[LoRARequest]:
        return sorted(self.lora.registered.values(), key=lambda r: r.lora_int_id) if self.lora else []

    def _adapters_in_use(self) -> set[int]:
        return self.scheduler.running_adapters() | self.scheduler.waiting_adapters()

    def _retire_unloaded_adapters(self) -> None:
        if self.lora is not None and self.lora.retiring:
            self.lora.retire_idle(self._adapters_in_use())

    def lora_adapter_names(self) -> tuple[list[str], list[str]]:
        """(adapters of running requests, adapters of waiting requests), for vllm:lora_requests_info."""
        if self.lora is None:
            return [], []
        return self.lora.names(self.scheduler.running_adapters()), self.lora.names(self.scheduler.waiting_adapters())
