"""The engine core: admit, schedule, run one forward, sample, report. One process per role.

`add_request` runs the admission function (I1) before anything exists for the request;
`step` runs one scheduler step and returns what each touched request produced; `abort`
ends a queued or running request at once and frees its pages.

Before every forward the batch is checked (I3, I4; `engine/batch.py`). A sequence that fails
is ended with FinishReason.ABORT and error_code ISOLATION_CHECK_FAILED, its pages are freed,
and the batch is built again without it: the other requests of the step still run.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from kvseal._testing.faults import Fault, is_active
from kvseal.admission import AdmissionLimits, admit, with_max_tokens
from kvseal.config import EngineArgs, ModelConfig
from kvseal.engine.batch import PreparedForward, PromptRows, build_forward_batch, check_forward
from kvseal.engine.gpu_memory import model_bytes, plan_gpu_pool
from kvseal.engine.model_runner import ModelRunner
from kvseal.engine.output import OutputState, text_decoder
from kvseal.engine.sampler import prompt_logprobs_of, sample
from kvseal.engine.scheduler import Scheduler
from kvseal.errors import ConfigError, InvalidParameter, IsolationViolation
from kvseal.kvcache.manager import KVCacheManager
from kvseal.kvcache.pool import KVPool
from kvseal.kvcache.reserve import PoolGeometry, PoolReservation
from kvseal.models.gguf_blocks import GgufBlocks, read_gguf_blocks
from kvseal.models.llama import CausalLM
from kvseal.models.loader import LoadedModel, folder_config, load_model
from kvseal.models.tensor_parallel import RankLayout
from kvseal.ops import select_ops
from kvseal.ops.device import DeviceInfo, resolve_device
from kvseal.parallel.driver import RankOptions, RankPlacement, TensorParallelDriver
from kvseal.parallel.group import RankFailure
from kvseal.parallel.rank_device import RankDevice
from kvseal.parallel.tp_key import engine_secret
from kvseal.parallel.worker import finish_model
from kvseal.prompting import encode_text
from kvseal.structured.compiler import GrammarCompilerPool, GrammarPoolStats
from kvseal.structured.matching import grammar_allows_a_token, new_matcher
from kvseal.types import (
    DEFAULT_TENANT,
    ISOLATION_CHECK_FAILED,
    NO_TOKEN_LEFT_BOTH,
    NO_TOKEN_LEFT_GRAMMAR,
    NO_TOKEN_SATISFIES_CONSTRAINTS,
    FinishReason,
    Request,
    RequestOutput,
    RequestTiming,
    SamplingParams,
    ScheduledChunk,
    TokenLogprobs,
)

logger = logging.getLogger("kvseal")

MAX_EPOCHS_AHEAD = 65_536  # request ids a forget named that have not arrived yet (`LLMEngine.forget_tenant`)


def _no_text(token_ids: list[int]) -> str:
    return ""


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_pages_used: int
    num_pages_free: int
    num_preemptions: int
    num_isolation_violations: int  # requests ended because an isolation check refused their forward
    num_pages_scrubbed: int  # pages the scrub policy overwrote since start-up (KVCacheManager, I7)
    grammar: GrammarPoolStats = GrammarPoolStats()  # structured-output compiles (workers, queue, stops)


class LLMEngine:
    def __init__(self, args: EngineArgs, loaded: LoadedModel | None = None,
                 pool_reservation: PoolReservation | None = None) -> None:
        """pool_reservation: the pool's memory, reserved before torch was imported
        (`kvseal.kvcache.reserve`); adopted if it is exactly the pool resolved here, else released."""
        torch.manual_seed(args.seed)
        if args.num_threads is not None:
            torch.set_num_threads(args.num_threads)
        # the device, then the kernels (native: built now, or found in the user's cache; --native),
        # so that `--device cuda` without a GPU or `--native require` without a compiler fails
        # before the weights load
        args = args.on_device(resolve_device(args.device))
        self.args = args
        self.device = DeviceInfo.of(args.device)
        self.ops = select_ops(args.native, args.device, attention_backend=args.attention_backend)
        tp = args.tensor_parallel_size
        if args.node_rank != 0:
            raise ConfigError(f"--node-rank {args.node_rank} holds worker ranks only: run `kvseal tp-node` there; "
                              f"the engine (and its scheduler) runs on node 0")
        if loaded is not None and tp > 1:
            raise ConfigError("a tensor-parallel engine loads its own shards; pass the model by name, not loaded")
        # rank 0's device (cuda:0 on CUDA, its forward's collectives over nccl): ConfigError now where
        # this node has fewer GPUs than ranks
        self.rank_device = RankDevice.here(args.device, 0, args.ranks_per_node) if tp > 1 else None
        if self.rank_device is not None:
            self.rank_device.enter()
        # the ranks' key file (exists, 0600, a key) before the weights load: a bad one fails in a second
        tp_key = engine_secret(args.tp_key_file, args.nnodes) if tp > 1 else None
        free_before_weights = self.device.free_bytes
        pool_ahead: KVPool | None = None
        try:
            pool_ahead = self._pool_while_loading(args, loaded, pool_reservation)
        finally:
            if pool_reservation is not None and (pool_ahead is None or pool_ahead.reserved is not pool_reservation):
                pool_reservation.release()
        self.loaded = loaded or load_model(args.model, args.torch_dtype, rank=(0, tp) if tp > 1 else None,
                                           tokenizer_folder=args.tokenizer)
        if free_before_weights is not None and next(self.loaded.model.parameters()).device.type == "cuda":
            free_before_weights += model_bytes(self.loaded.model)  # given on the GPU: its weights were not free
        self.model_config: ModelConfig = self.loaded.config
        self.tokenizer: Any = self.loaded.tokenizer
        # by SamplingParams.skip_special_tokens: [False] keeps them, [True] (the default) skips them
        self._decoders = (text_decoder(self.tokenizer, skip_special_tokens=False), text_decoder(self.tokenizer))
        if not args.is_pool_sized_by_device:  # a pool that cannot be honoured fails before the weights move
            args.resolve(self.model_config)
        model = finish_model(self.loaded.model.to(device=args.device), args.torch_dtype, args.quantization, self.ops,
                             tp, self._gguf_blocks(args))
        self.gpu_memory = None if not args.is_pool_sized_by_device or free_before_weights is None else plan_gpu_pool(
            model, free_before_weights, args.gpu_memory_utilization, args.max_num_batched_tokens,
            min(args.max_num_seqs, args.max_num_batched_tokens), args.page_size, args.torch_dtype)
        kv_memory = None if self.gpu_memory is None else self.gpu_memory.require_room()
        self.cache_config, self.scheduler_config = args.resolve(self.model_config, kv_memory)
        self.limits = AdmissionLimits(self.scheduler_config.max_model_len, self.cache_config.kv_cache_tokens,
                                      self.model_config.vocab_size)
        cfg = self.model_config
        layout = RankLayout.of(cfg, 0, tp) if tp > 1 else None
        num_kv_heads = layout.num_kv_heads if layout is not None else cfg.num_kv_heads
        self.kv = KVCacheManager(self.cache_config, cfg.num_layers, num_kv_heads, cfg.head_dim,
                                 record_kernels=self.ops.record_kernels(), mirrored=tp > 1, pool=pool_ahead)
        self.scheduler = Scheduler(self.scheduler_config, self.kv)
        # Tensor parallelism: ranks 1..tp-1 in their own processes, driven from here (rank 0)
        self.driver: TensorParallelDriver | None = None
        if layout is not None:
            assert tp_key is not None  # drawn or read above whenever tp > 1
            self.driver = self._start_ranks(args, layout, model, tp_key)
        self.runner = ModelRunner(model, self.kv.pool)
        self._outputs: dict[str, OutputState] = {}
        self._num_preemptions = 0
        self._num_isolation_violations = 0
        self._grammars: GrammarCompilerPool | None = None
        self._grammar_config = args.grammar_config
        # request id -> (tenant, cache epoch): requests a frontend started before it had this engine
        # forget their tenant, whose message may arrive only after (`forget_tenant`, `arrival_epoch`)
        self._epochs_ahead: OrderedDict[str, tuple[str, int]] = OrderedDict()
        # Called with a finishing request while it still owns its pages (finish_reason set);
        # the prefill role exports the request's KV here. None: nothing to do.
        self.before_free: Callable[[Request], None] | None = None
        self._log_config(args)

    def _gguf_blocks(self, args: EngineArgs) -> GgufBlocks | None:
        """The GGUF's blocks for one-row steps (`--gguf-q4-rows`: its Q4_1 decoder linears, its
        Q8_0 lm_head): read where the model is a .gguf served whole, in bfloat16 on the CPU,
        unquantized; None elsewhere, or where the file holds neither."""
        path = self.loaded.path
        if not args.gguf_q4_rows or path.suffix != ".gguf" or args.tensor_parallel_size > 1 \
                or args.device != "cpu" or args.torch_dtype != torch.bfloat16 or args.quantization != "none" \
                or not self.ops.takes_gguf_blocks():
            return None
        blocks = read_gguf_blocks(path, self.loaded.config)
        return None if blocks.is_empty else blocks

    @staticmethod
    def _pool_while_loading(args: EngineArgs, loaded: LoadedModel | None,
                            reservation: PoolReservation | None) -> KVPool | None:
        """A one-process CPU engine's pool, built before the weights load, so that its memory is
        committed (`KVPool(touch_later=True)`) while they load and pack on the other core: the
        first touch of a 2 GiB pool is most of a cold start on this project's VMs (4-10 s). Its
        dimensions are the ones the engine resolves after loading (the model folder's config.json;
        a pool that cannot be honoured fails here, before the weights load); the reservation's
        mappings where it is exactly this pool. None elsewhere."""
        if args.device != "cpu" or args.tensor_parallel_size > 1 or args.is_pool_sized_by_device:
            return None
        cfg = loaded.config if loaded is not None else folder_config(args.model)
        cache, _ = args.resolve(cfg)
        dims = (cfg.num_layers, cache.num_pages, cache.page_size, cfg.num_kv_heads, cfg.head_dim)
        geometry = PoolGeometry(*dims, str(cache.dtype).removeprefix("torch."))
        if reservation is not None and reservation.geometry != geometry:
            logger.info("the KV pool reserved at start-up (%s) is not the one resolved (%s): built again",
                        reservation.geometry, geometry)
            reservation = None
        return KVPool(*dims, cache.dtype, device=cache.device, touch_later=True, reserved=reservation)

    def _start_ranks(self, args: EngineArgs, layout: RankLayout, model: CausalLM, key: bytes) -> TensorParallelDriver:
        options = RankOptions(str(self.loaded.path), args.dtype, args.quantization, args.native, args.seed,
                              args.num_threads, self.cache_config.num_pages, self.cache_config.page_size,
                              self.cache_config.check_kv, args.device, args.attention_backend)
        place = RankPlacement(args.tensor_parallel_size, args.nnodes, args.master_addr, args.master_port,
                              args.tp_timeout_s)
        driver, group = TensorParallelDriver.start(options, place, self.kv, key)
        try:
            model.use_tensor_parallel(layout, group)
            assert self.rank_device is not None  # chosen in __init__ whenever tp > 1
            ready = driver.wait_ready(self.kv.pool.num_bytes, layout.num_kv_heads, self.rank_device)
        except Exception:
            driver.close()
            raise
        logger.info("tensor parallel: %d ranks (pids %s), KV heads per rank %s, pool bytes per rank %s, forward "
                    "collectives over %s", args.tensor_parallel_size, driver.ranks.pids,
                    [r.num_kv_heads for r in ready], [r.pool_bytes for r in ready], group.forward_backend)
        return driver

    def _log_config(self, args: EngineArgs) -> None:
        c, s = self.cache_config, self.scheduler_config
        logger.info(
            "kvseal engine: model=%s arch=%s dtype=%s max_model_len=%d kv_cache_tokens=%d (%d pages x %d) "
            "kv_bytes_per_token=%d max_num_batched_tokens=%d max_prefill_chunk_tokens=%d fair_share_tokens=%d "
            "attention_cost_context=%d max_num_seqs=%d kv_scrub=%s check_kv=%s prefix_caching=%s torch_threads=%d "
            "native=%s ops=%s gguf_q4_rows=%s grammar_compile_timeout_s=%g grammar_compile_workers=%d device=%s (%s) "
            "kv_pool_bytes=%d kv_pool_reserved_early=%s tensor_parallel_size=%d tp_timeout_s=%g nnodes=%d master=%s:%d",
            self.loaded.path, self.model_config.architecture, args.dtype, s.max_model_len, c.kv_cache_tokens,
            c.num_pages, c.page_size, args.capacity(self.model_config).bytes_per_token,
            s.max_num_batched_tokens, s.max_prefill_chunk_tokens, s.fair_share_tokens, s.attention_cost_context,
            s.max_num_seqs, c.kv_scrub, c.check_kv, c.enable_prefix_caching, torch.get_num_threads(),
            args.native, self.ops.name, args.gguf_q4_rows, args.grammar_compile_timeout_s, args.grammar_compile_workers,
            args.device, self.device.describe(), self.kv.pool.num_bytes, self.kv.pool.reserved is not None,
            args.tensor_parallel_size, args.tp_timeout_s, args.nnodes, args.master_addr, args.master_port,
        )

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return encode_text(self.tokenizer, prompt)
        if not isinstance(prompt, list):
            raise InvalidParameter("prompt must be a string or a list of token ids", param="prompt")
        return prompt

    @property
    def grammars(self) -> GrammarCompilerPool:
        """The structured-output compiler (built at first use, its worker processes with it;
        most deployments never need it)."""
        if self._grammars is None:
            self._grammars = GrammarCompilerPool(self.tokenizer, self.model_config.vocab_size,
                                                 self.model_config.eos_token_ids, self._grammar_config)
        return self._grammars

    def grammar_stats(self) -> GrammarPoolStats:
        return self._grammars.stats() if self._grammars is not None else GrammarPoolStats()

    def close(self) -> None:
        """Stop what the engine runs besides its own thread (the grammar workers)."""
        if self._grammars is not None:
            self._grammars.close()
        if self.driver is not None:
            self.driver.close()

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    tenant: str = DEFAULT_TENANT, compiled_grammar: Any = None,
                    cache_epoch: int | None = None) -> Request:
        """Admit (I1) and queue a request; raises RequestRejected before any state exists.

        Its prefix-cache namespace is derived from `tenant` (I5, `Request.cache_namespace`); the
        tenant comes from an authenticated frontend (I9) or the offline caller. `cache_epoch`:
        the tenant's (`cache_epoch`) when the request's message arrived, if it waited since
        (a grammar compile); None: the tenant's now.

        A structured-output request takes its `compiled_grammar` from the caller (the engine
        loop compiles off the loop); without one it is compiled here, blocking (offline API)."""
        if request_id in self._outputs:
            raise InvalidParameter(f"request id {request_id!r} is already in use", param="request_id")
        token_ids = admit(self.tokenize(prompt), params, self.limits)
        params = with_max_tokens(params, len(token_ids), self.limits)
        # Unseeded requests draw from the OS's random source: no tenant can predict or
        # replay another's samples from the engine seed and arrival order.
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        generator = torch.Generator().manual_seed(seed)
        request = Request(request_id, tenant, token_ids, params, generator=generator,
                          cache_epoch=self.arrival_epoch(request_id, tenant) if cache_epoch is None else cache_epoch)
        if params.structured is not None:
            request.grammar = new_matcher(compiled_grammar if compiled_grammar is not None
                                          else self.grammars.compile_now(tenant, params.structured),
                                          params.structured.reasoning)
        self._outputs[request_id] = OutputState(request, self._decoder_for(params),
                                                self.model_config.eos_token_ids)
        self.scheduler.add(request)
        return request

    def _decoder_for(self, params: SamplingParams) -> Callable[[list[int]], str]:
        """The request's ids -> text: none at all with detokenize=False (vLLM's: token ids only)."""
        return self._decoders[params.skip_special_tokens] if params.detokenize else _no_text

    def add_prefilled(self, request_id: str, tenant: str, prompt_token_ids: list[int], params: SamplingParams,
                      first_token: int, first_logprobs: TokenLogprobs | None,
                      generator_state: torch.Tensor, num_cached_tokens: int = 0,
                      compiled_grammar: Any = None,
                      prompt_logprobs: list[TokenLogprobs | None] | None = None,
                      prefill_timing: RequestTiming | None = None,
                      cache_epoch: int = 0) -> RequestOutput:
        """Run a request whose prompt KV is already in pages it holds, written and recorded in
        every layer (a verified PD handoff), and whose first token was sampled elsewhere.

        Its first `num_cached_tokens` positions are shared prefix-cache pages of its tenant's
        namespace; its own full prompt pages are published to the cache now.
        The caller has admitted it (I1) and verified the KV (I4); the engine only continues it.
        Returns the report of the first token (finished if that token ends the request). A
        structured-output request's grammar (`compiled_grammar`, compiled off the loop by the
        caller; without one it is compiled here, blocking) is advanced by the first token.
        `prompt_logprobs`: those prefill computed, where the request asked for them (verified).
        `prefill_timing`: how long it queued and prefilled there; its end reports them with the
        decode time measured here from now on (without them, as decode saw it: no queue, no prefill).
        `cache_epoch`: its tenant's when its reservation was asked for (the namespace its pages
        were reserved in).
        """
        if request_id in self._outputs:
            raise InvalidParameter(f"request id {request_id!r} is already in use", param="request_id")
        generator = torch.Generator()
        generator.set_state(generator_state)
        request = Request(request_id, tenant, list(prompt_token_ids), params, num_cached_tokens=num_cached_tokens,
                          generator=generator,
                          num_computed_tokens=len(prompt_token_ids),
                          max_num_pages=len(self.kv.allocator.pages_of(request_id)),
                          prompt_logprobs=prompt_logprobs, prefilled_timing=prefill_timing,
                          cache_epoch=cache_epoch)
        request.first_scheduled_s = request.arrival_s  # it runs from now on; a preemption keeps this
        self.kv.publish_written(request)
        if params.structured is not None:  # the first token was sampled under the same grammar
            request.grammar = new_matcher(compiled_grammar if compiled_grammar is not None
                                          else self.grammars.compile_now(tenant, params.structured),
                                          params.structured.reasoning)
        state = self._outputs[request_id] = OutputState(request, self._decoder_for(params),
                                                        self.model_config.eos_token_ids)
        self.scheduler.add_running(request)
        state.append_token(first_token)
        if first_logprobs is not None:
            request.output_logprobs.append(first_logprobs)
        if request.finish_reason is not None:
            return self._finish(request, request.finish_reason)
        return state.report(finished=False)

    def abort(self, request_id: str, reason: str = "aborted", error_code: str | None = None) -> RequestOutput | None:
        """End a queued or running request now; its pages are free when this returns. `error_code`:
        the output's, for a cause the frontend acts on (`ENGINE_UNAVAILABLE`: the engine was lost)."""
        request = self.scheduler.find(request_id)
        if request is None:
            return None
        if is_active(Fault.ABORT_KEEPS_PAGES):
            request.finish_reason = FinishReason.ABORT
            return self._outputs[request_id].report(finished=True, error=reason, error_code=error_code,
                                                    num_kv_tokens_written=self.kv.num_written_tokens(request_id))
        return self._finish(request, FinishReason.ABORT, error=reason, error_code=error_code)

    def cache_epoch(self, tenant: str) -> int:
        """The tenant's prefix-cache epoch here (`KVCacheManager.cache_epoch`): what a request of
        it that arrives now takes."""
        return self.kv.cache_epoch(tenant)

    def arrival_epoch(self, request_id: str, tenant: str) -> int:
        """The cache epoch of a request whose message arrives now: its tenant's now, or the one
        before a forget that named it as started earlier (`forget_tenant`'s `request_ids`)."""
        ahead = self._epochs_ahead.pop(request_id, None)
        return ahead[1] if ahead is not None and ahead[0] == tenant else self.cache_epoch(tenant)

    def forget_tenant(self, tenant: str, request_ids: Collection[str] = ()) -> int:
        """Drop the tenant's prefix cache and close it to the tenant's requests already here
        (`KVCacheManager.forget_tenant`), and to `request_ids`, the tenant's requests that a
        frontend started before and whose message may arrive only later; the tenant's other
        requests that arrive later are a new tenant's. Returns the cached pages freed now (the
        rest leave with their last reader). The ids are remembered until their message comes,
        at most `MAX_EPOCHS_AHEAD` of them (the oldest go first: one that never came)."""
        before = self.cache_epoch(tenant)
        for request_id in request_ids:
            self._epochs_ahead[request_id] = (tenant, before)
        while len(self._epochs_ahead) > MAX_EPOCHS_AHEAD:
            self._epochs_ahead.popitem(last=False)
        num_freed = len(self.kv.forget_tenant(tenant))
        logger.warning("forgot the prefix cache of tenant %r: %d cached pages freed now (pages still read leave with "
                       "their last reader); its requests here before are closed to the cache", tenant, num_freed)
        return num_freed

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def find(self, request_id: str) -> Request | None:
        """The queued or running request with this id, if any."""
        return self.scheduler.find(request_id)

    def unfinished_ids(self) -> list[str]:
        return [r.request_id for r in (*self.scheduler.running, *self.scheduler.waiting)]

    def stats(self) -> EngineStats:
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting), self.kv.num_used_pages,
                           self.kv.num_free_pages, self._num_preemptions, self._num_isolation_violations,
                           self.kv.num_pages_scrubbed, self.grammar_stats())

    def step(self) -> list[RequestOutput]:
        """One scheduler step and at most one forward. Returns one output per request that
        produced a token or finished (including requests an isolation check ended)."""
        plan = self.scheduler.schedule()
        self._num_preemptions += len(plan.preempted)
        with self._ranks():
            prepared, chunks, refused = self._checked_forward(plan.chunks)
            if prepared is None:
                return refused
            with self.kv.recording(prepared.writes):
                logits = self.runner.run(prepared.batch).raw_logits
        if prepared.prompt_rows:
            self._record_prompt_logprobs(prepared.prompt_rows, logits)
            logits = logits[list(prepared.sample_rows)]
        return refused + self._update(chunks, logits)

    @contextlib.contextmanager
    def _ranks(self) -> Iterator[None]:
        """A tensor-parallel step holds the ranks' group; a failed collective stops the ranks."""
        if self.driver is None:
            yield
            return
        try:
            self.driver.raise_if_failed()
            with self.driver.exclusive():
                yield
        except RankFailure:
            self._fail_ranks()
            raise

    def check_ranks(self) -> None:
        """RankFailure (the ranks are stopped) if a tensor-parallel rank died or hung, also while
        the engine is idle (its keep-alive found it); nothing for a single-process engine."""
        if self.driver is not None and self.driver.failure is not None:
            self._fail_ranks()
            raise self.driver.failure

    def _fail_ranks(self) -> None:
        """A rank died or hung: the ranks are stopped (by PID) and this engine serves no more.
        The caller's exception ends every in-flight request with an error (fail closed)."""
        assert self.driver is not None, "only a tensor-parallel engine has ranks to fail"
        logger.error("a tensor-parallel rank failed; stopping the ranks (pids %s)", self.driver.ranks.pids)
        self.driver.close()

    def _checked_forward(self, chunks: list[ScheduledChunk]
                         ) -> tuple[PreparedForward | None, list[ScheduledChunk], list[RequestOutput]]:
        """Build the batch and check it; drop every refused sequence (its request is aborted)
        and build again until what is left passes. Returns (batch or None, its chunks, aborts)."""
        refused: list[RequestOutput] = []
        while chunks:
            prepared = build_forward_batch(chunks, self.kv)
            violations = check_forward(prepared, self.kv)
            if self.driver is not None:  # every rank checks too; one rank's refusal refuses it on all
                violations = self._agree(prepared, violations)
            if not violations:
                return prepared, chunks, refused
            refused += [self._isolation_abort(v) for v in violations]
            dropped = {v.request_id for v in violations}
            chunks = [c for c in chunks if c.request.request_id not in dropped]
        return None, [], refused

    def _agree(self, prepared: PreparedForward, violations: list[IsolationViolation]) -> list[IsolationViolation]:
        assert self.driver is not None
        return self.driver.agree(prepared.batch, prepared.writes, prepared.writes.starts.tolist(), violations)

    @staticmethod
    def _record_prompt_logprobs(spans: tuple[PromptRows, ...], logits: torch.Tensor) -> None:
        """The logprobs of the prompt tokens this forward predicted, onto each request's list."""
        for span in spans:
            request = span.request
            assert request.prompt_logprobs is not None and len(request.prompt_logprobs) == span.first_token, \
                "prompt logprobs arrive in prompt order, each position once"
            tokens = request.prompt_token_ids[span.first_token:span.first_token + span.num_rows]
            rows = logits[span.first_row:span.first_row + span.num_rows]
            request.prompt_logprobs += prompt_logprobs_of(rows, tokens, request.params.prompt_logprobs or 0)

    def _update(self, chunks: list[ScheduledChunk], logits: torch.Tensor) -> list[RequestOutput]:
        sampled = [c.request for c in chunks if c.is_last_chunk]
        for chunk in chunks:
            chunk.request.num_computed_tokens += chunk.num_new_tokens
            self.kv.publish_written(chunk.request)
        outputs = []
        samples = sample(logits, sampled, self.model_config.eos_token_ids, self.ops)
        for request, (token, logprobs) in zip(sampled, samples):
            if token is None:  # its grammar (and allowed_token_ids) left no token: it ends without one
                why = NO_TOKEN_LEFT_BOTH if request.params.allowed_token_ids is not None and \
                    grammar_allows_a_token(request, logits.shape[-1]) else NO_TOKEN_LEFT_GRAMMAR
                outputs.append(self._finish(request, FinishReason.ABORT, error=why,
                                            error_code=NO_TOKEN_SATISFIES_CONSTRAINTS))
                continue
            state = self._outputs[request.request_id]
            state.append_token(token)
            if logprobs is not None:
                request.output_logprobs.append(logprobs)
            if request.finish_reason is not None:
                error = str(request.stop_reason) if request.finish_reason is FinishReason.ABORT else None
                outputs.append(self._finish(request, request.finish_reason, error=error))
            else:
                outputs.append(state.report(finished=False))
        return outputs

    def _finish(self, request: Request, reason: FinishReason, error: str | None = None,
                error_code: str | None = None) -> RequestOutput:
        num_written = self.kv.num_written_tokens(request.request_id)
        request.finish_reason = reason
        if self.before_free is not None:
            self.before_free(request)
        self.scheduler.finish(request)
        return self._outputs.pop(request.request_id).report(finished=True, error=error, error_code=error_code,
                                                            num_kv_tokens_written=num_written)

    def _isolation_abort(self, violation: IsolationViolation) -> RequestOutput:
        request = self.scheduler.find(violation.request_id)
        assert request is not None, "an isolation violation names a request the scheduler holds"
        logger.error("isolation check failed, aborting request %s (tenant %s): %s",
                     request.request_id, request.tenant, violation)
        self._num_isolation_violations += 1
        return self._finish(request, FinishReason.ABORT, error=f"isolation check failed: {violation}",
                            error_code=ISOLATION_CHECK_FAILED)

    def check_integrity(self, held: Collection[str] = ()) -> None:
        """Invariant checks for tests: page ownership (I3) and queue/page agreement.

        `held`: ids that may own pages without running (a decode engine's reservations)."""
        self.kv.check_integrity()
        live = {r.request_id for r in self.scheduler.running} | set(held)
        for request in self.scheduler.waiting:
            assert not self.kv.allocator.owns(request.request_id), f"waiting {request.request_id} holds pages"
        assert self.kv.allocator.owner_ids() <= live, "pages owned by a request that is not running"
