"""The engine: requests in, one scheduler step at a time, RequestOutputs out.

`add_request` validates and queues; `step` schedules a batch, runs the model once, samples, then
detokenizes and applies stop conditions; `abort` drops a request and frees its KV blocks at any time.
The offline `LLM` and the servers both drive this class.
What happens to the sampled tokens is the output processor's (output_processor.py), including the
deferred text: a step's detokenizing and outputs done after the next step is launched, on CUDA. With
async scheduling (async_scheduling.py) `step` runs one launched step ahead of the host.
"""
from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable

import torch

from ..config import EngineConfig, ModelSpec
from ..kv_transfer import connector_factory, resolve_kv_transfer
from ..kv_transfer.engine_step import KVTransferStep, build_connector
from ..lora.manager import LoRAManager
from ..model_executor.model_loader import inspect_model_dir, resolve_dtype
from ..model_executor.step_timer import StepProfileLog
from ..sampling_params import SamplingParams
from ..sequence import ScheduledBatch, Sequence
from ..spec_decode.config import SpeculativeConfig
from ..spec_decode.speculator import Speculator
from .async_scheduling import StepPipeline
from .detokenizer import IncrementalDetokenizer, StopStringMatcher, load_tokenizer
from .engine_adapters import EngineAdapters
from .errors import StepFailedError
from .kv_event_publisher import KVEventsConfig, KVEventStream
from .model_setup import build_block_manager, build_runner, draft_files, memory_summary
from .output_processor import OutputProcessor
from .outputs import RequestOutput
from .request import Completion, Request, check_prompt_length, prompt_tokens
from .scheduler import Scheduler, SchedulerConfig
from .tensor_parallel import TensorParallelGroup

logger = logging.getLogger(__name__)
# At DEBUG, every 100 steps: the mean time of each phase of a step (see model_executor/step_timer).
profile_logger = logging.getLogger("kubeinfer.engine.step_profile")


class LLMEngine(EngineAdapters):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        speculative = SpeculativeConfig.parse(config.speculative_config)  # refused before any model work
        kv_events = KVEventsConfig.parse(config.kv_events_config)
        kv_transfer = resolve_kv_transfer(config.kv_transfer_config, config.kv_offloading_size,
                                          config.kv_offloading_backend)
        if kv_transfer is not None:
            connector_factory(kv_transfer.kv_connector)  # an unknown connector is refused before the model loads
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device: {config.device} asked for, but this torch ({torch.__version__}) sees no CUDA "
                             "device (a CPU-only build, or no GPU visible); use --device cpu")
        files = inspect_model_dir(config.model, config.quantization)
        self.model_files = files
        self.hf_config = files.config
        self.spec = ModelSpec(files.config, files.architecture)
        self.dtype = resolve_dtype(config.dtype, files.config, self.device)
        self.max_model_len = config.max_model_len or self.spec.max_position_embeddings
        if self.max_model_len > self.spec.max_position_embeddings:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings "
                             f"({self.spec.max_position_embeddings})")
        self.eos_token_ids = frozenset(files.eos_token_ids)
        self.tokenizer = load_tokenizer(config.tokenizer or config.model)
        # Tensor parallelism: the other ranks start and join here, before any weight is read
        self.ranks = TensorParallelGroup(config, self.spec, self.device) if config.world_size > 1 else None
        self.lora = (LoRAManager(self.spec, max_loras=config.max_loras, max_lora_rank=config.max_lora_rank,
                                 max_cpu_loras=config.max_cpu_loras, device=self.device, dtype=self.dtype,
                                 ranks=self.ranks) if config.enable_lora else None)
        pool = self.lora.pool if self.lora else None
        budget = config.max_num_batched_tokens or max(2048, config.max_num_seqs)
        draft = (draft_files(speculative.model, self.max_model_len, self.tokenizer)
                 if speculative and speculative.model else None)
        try:
            self.runner, self.num_kv_blocks, draft_runner = build_runner(config, files, self.spec, self.device,
                                                                         self.dtype, self.max_model_len, pool, budget,
                                                                         draft, self.ranks)
        except BaseException:
            self.shutdown()
            raise
        self.block_manager = build_block_manager(config, self.spec, self.runner, self.num_kv_blocks)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, budget, self.max_model_len,
                                                   config.scheduling_policy), self.block_manager, pool)
        try:
            self.kv_transfer = (KVTransferStep(build_connector(kv_transfer, config, self.spec, self.runner,
                                                               self.block_manager), self.scheduler)
                                if kv_transfer else None)
        except BaseException:
            self.shutdown()
            raise
        self.kv_events = (KVEventStream(kv_events, self.block_manager, self._lora_name, config.kv_events_key)
                          if kv_events else None)
        self.speculator = speculative and Speculator(speculative, self.max_model_len, draft_runner, self.spec.vocab_size)
        if self.speculator is not None:
            self.speculator.attach(self.runner)
        self.step_timer = self.runner.timer
        if profile_logger.isEnabledFor(logging.DEBUG):
            self.step_timer.enabled, self.step_timer.log = True, StepProfileLog(profile_logger)
        self.requests: dict[str, Request] = {}
        self._rng = random.Random(config.seed)
        self._rng_lock = threading.Lock()  # prepare_request runs on front-end threads
        self.grammar_compiler = None  # built on the first structured-output request
        self.num_structured_requests = 0
        self.pipeline = StepPipeline(self) if config.async_scheduling else None
        # Async scheduling reads a step's ids while the next one runs: its text needs no deferring on top.
        self.defer_text = self.pipeline is None and (config.async_output_processing if config.async_output_processing
                                                     is not None else self.device.type == "cuda")
        self.outputs = OutputProcessor(self.scheduler, self.requests, max_model_len=self.max_model_len,
                                       token_text=self._token_text, after_outputs=self._retire_unloaded_adapters,
                                       defer_text=self.defer_text)
        # Where deferred outputs go as soon as they are built, inside the next step (the async engine's slots);
        # when None, `step` returns them.
        self.deliver_early: Callable[[list[RequestOutput]], None] | None = None
        self.runner.defer_token_copy = self.defer_text or self.pipeline is not None
        logger.info("engine ready: %s (%s) on %s, %s%s, %d KV blocks of %d tokens; %s", config.model, files.architecture,
                    self.device, self.dtype, f" ({files.quantization.describe()})" if files.quantization else "",
                    self.num_kv_blocks, config.block_size, memory_summary(self.runner, self.num_kv_blocks))

    def shutdown(self) -> None:
        """End the other tensor-parallel ranks (they exit 0); nothing to do on one device."""
        if self.ranks is not None:
            self.ranks.shutdown()
            self.ranks = None

    # -- requests -----------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model directory has no tokenizer; pass prompt token ids instead of text")
        return self.tokenizer.encode(prompt)

    def add_request(self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams | None = None,
                    *, priority: int = 0, lora_id: int = 0) -> Request:
        request = self.prepare_request(request_id, prompt, params, priority=priority, lora_id=lora_id)
        self.submit(request)
        return request

    def prepare_request(self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams | None = None,
                        *, priority: int = 0, lora_id: int = 0) -> Request:
        """Tokenize and validate; raises ValueError before any model work. Touches no scheduler state,
        so a server may call it off the engine thread."""
        params = params or SamplingParams()
        if priority and self.config.scheduling_policy != "priority":
            raise ValueError(f"priority: got {priority}, but priority scheduling is not enabled "
                             "(scheduling_policy='priority', --scheduling-policy priority)")
        if lora_id and (self.lora is None or lora_id not in self.lora.registered):
            raise ValueError(f"lora_request: adapter id {lora_id} is not loaded"
                             + ("" if self.lora else "; LoRA is not enabled (enable_lora=True / --enable-lora)"))
        lora_generation = self.lora.generation(lora_id) if lora_id else 0  # ids can be reused; generations can't
        prompt_text, token_ids = prompt_tokens(prompt, self.tokenize, self.spec.vocab_size)
        check_prompt_length(len(token_ids), params, self.max_model_len, self.num_kv_blocks * self.config.block_size)
        params.check_token_ids(self.spec.vocab_size)
        params.eos_token_ids = frozenset() if params.ignore_eos else self.eos_token_ids
        grammars = [self._grammar_for(params) for _ in range(params.n)] if params.structured_outputs else None
        request = Request(request_id, prompt_text, token_ids, params)
        for index in range(params.n):
            # On the logits' device: the sampler draws each sequence's noise there.
            generator = torch.Generator(device=self.device).manual_seed(self._seed_for(params.seed, index))
            seq = Sequence(request_id, token_ids, params, generator, priority=priority, lora_id=lora_id, index=index,
                           arrival_time=request.arrival_time, lora_generation=lora_generation)
            seq.grammar = grammars[index] if grammars else None
            detokenizer = (IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens)
                           if self.tokenizer is not None else None)
            request.completions.append(Completion(seq, detokenizer, StopStringMatcher(params)))
        return request

    def _grammar_for(self, params: SamplingParams):
        """A matcher for the request's constraint (the grammar compiled once, on first use, and cached)."""
        spec = params.structured_outputs
        if self.tokenizer is None:
            raise ValueError(f"{spec.field}: structured output needs the model's tokenizer, and this model has none")
        if self.grammar_compiler is None:
            from ..structured_output.grammar import GrammarCompiler  # llguidance: only when asked for
            self.grammar_compiler = GrammarCompiler(self.tokenizer, self.spec.vocab_size, self.eos_token_ids)
        return self.grammar_compiler.matcher(spec)

    def submit(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.num_structured_requests += request.params.structured_outputs is not None
        for completion in request.completions:
            self.scheduler.add(completion.seq)

    def _seed_for(self, seed: int | None, index: int) -> int:
        if seed is None:
            with self._rng_lock:
                return self._rng.getrandbits(63)
        return seed if index == 0 else hash((seed, index)) & ((1 << 63) - 1)

    def abort(self, request_id: str) -> bool:
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.abort(request_id)
        self._retire_unloaded_adapters()
        return True

    def reset_prefix_cache(self) -> None:
        """Forget the cached blocks no request holds (engine thread); subscribers get AllBlocksCleared."""
        self.block_manager.reset_prefix_cache()
        if self.kv_events is not None:
            self.kv_events.flush()

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished() or self.outputs.has_deferred
                or (self.pipeline is not None and self.pipeline.busy))

    # -- the step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduler step. A sequence that fails alone (its adapter, its text) ends its request with an
        error and the step goes on; if the model itself raises, the batch's requests end and
        StepFailedError carries their outputs. With async scheduling the outputs are those of the step
        launched before (core/async_scheduling.py)."""
        try:
            return self.pipeline.step() if self.pipeline is not None else self.synchronous_step()
        finally:  # the step's cache changes go out even when it failed
            if self.kv_events is not None:
                self.kv_events.flush()

    def synchronous_step(self) -> list[RequestOutput]:
        timer = self.step_timer
        timer.start()
        started = time.perf_counter()
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running, len(self.scheduler.waiting))
        batch, outputs = self.schedule()
        if not batch:
            return outputs + self.outputs.deferred_outputs() + self.outputs.finish({})
        try:
            sampled_seqs, result = self.runner.execute(batch)
        except Exception as error:
            outputs += self.outputs.deferred_outputs()  # the previous step's tokens are good: their text goes out
            raise self.step_failed(error, batch, outputs) from error
        if self.outputs.has_deferred:  # the device may still run this step: the previous step's text fills the wait
            early = self.outputs.deferred_outputs()
            if self.deliver_early is not None:
                self.deliver_early(early)
            else:
                outputs += early
            timer.mark("text")
        result.wait()  # the sampled token ids reach the host
        self.scheduler.on_step_done(batch)
        outputs += self.outputs.add_step(sampled_seqs, result, time.monotonic(), mark=timer.mark)
        if self.speculator is not None:  # the batch-1 switch weighs measured step costs (spec_decode/step_costs.py)
            self.speculator.step_done(batch, time.perf_counter() - started)
        timer.mark("deliver")  # the async engine's loop adds its hand-off to the slots to this phase
        return outputs

    def schedule(self) -> tuple[ScheduledBatch, list[RequestOutput]]:
        """The next batch, and the final outputs of the requests the scheduler ended unrun (their adapter)."""
        batch = self.scheduler.schedule()
        if self.kv_transfer is not None:  # the tier's saves and loads, before the forward reads the cache
            self.kv_transfer.run(batch)
        self.step_timer.mark("schedule")
        outputs = self.fail_requests({seq.request_id for seq in batch.failed},
                                     {seq.request_id: seq.error for seq in batch.failed})
        now = time.monotonic()
        for seq, _ in batch.entries:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
        return batch, outputs

    def step_failed(self, error: Exception, batch: ScheduledBatch, outputs: list[RequestOutput]) -> StepFailedError:
        """The model raised running `batch`: its requests end with the error; `outputs` go out with theirs."""
        in_batch = {seq.request_id for seq, _ in batch.entries}
        message = f"the model step failed: {type(error).__name__}: {error}"
        return StepFailedError(error, outputs + self.fail_requests(in_batch, dict.fromkeys(in_batch, message)))

    def fail_requests(self, request_ids: set[str], errors: dict[str, str | None]) -> list[RequestOutput]:
        """End every sequence of these requests with finish reason "abort" and the error; their final outputs."""
        return self.outputs.fail(request_ids, errors)

    def _token_text(self, token: int) -> str | None:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else None

    # -- state, for metrics and tests -----------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:  # of requests that produced their first token
        return self.outputs.num_prompt_tokens

    @property
    def num_generation_tokens(self) -> int:
        return self.outputs.num_generation_tokens

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)
