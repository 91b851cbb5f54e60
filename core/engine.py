"""The engine: an async API over a step loop that schedules, runs the model on a worker thread, and streams."""

from __future__ import annotations

import bisect
import logging
import math
import time
import uuid
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import anyio
import msgspec
import torch

from jitney.cache.sizing import available_memory
from jitney.core import assembly
from jitney.core import chat as chats
from jitney.core import events as ev
from jitney.core import grammar
from jitney.core import lookup
from jitney.core import processors
from jitney.core import selfcheck
from jitney.core.config import EngineConfig
from jitney.core.executor import ForwardThread, PreparedStep, StepExecutor
from jitney.core.faults import ErrorLog, PluginFault, batch_requests, notify_observers
from jitney.core.hooks import make_plugin_manager, registry
from jitney.core.models import cache_dir, load_model
from jitney.core.memory import MemoryUse, memory_use
from jitney.core.preemption import Preempter
from jitney.core.request import Completion, Request, RequestStatus, SamplingParams, cut_at_stop
from jitney.core.sequence import Collector, Sequence, greedy_decodes
from jitney.core.stream import TokenStream
from jitney.kernels import cpu_layers
from jitney.kernels.base import ATTN_NAME
from jitney.kernels.cpu_paged import CpuPagedAttention
from jitney.kernels.stored import PackedStore

if TYPE_CHECKING:
    from jitney.schedulers.base import Batch

log = logging.getLogger("jitney")

DRAFT_MARGIN = 1 << 30
"""Memory left over, beside the draft and the whole KV cache, for speculation to be on by default (bytes)."""
DRAFT_TOKENS = 8
"""The draft's proposals a request by default (`EngineConfig.speculative_tokens`; `speculative_max_rows` caps them
by the step's rows: 7 for two requests, 4 for three). The int8 draft agrees with the model on ~96% of next
tokens, so long runs are right: SmolLM2 on this project's 2-core CPU, chat-4's four questions one at a time,
4 / 6 / 8 proposals 3.98-4.38 / 3.80-4.28 / 3.61-3.89 s (117 / 91 / 72 steps), 10 and 12 no better; two at a
time 2.28-2.35 s at 4 against 2.20-2.26 at 8."""


class Engine:
    """Continuous batching over one model. Use it as ``async with Engine.from_pretrained(...) as engine``."""

    def __init__(self, model, tokenizer=None, config: EngineConfig | None = None, plugins: Iterable[object] = (),
                 clock: Callable[[], float] = time.perf_counter):
        self.model = model
        # every time the engine records (events, time to first token): a simulation gives it a virtual clock
        self.clock = clock
        self.tokenizer = tokenizer
        config = config or EngineConfig()
        if config.chunk_context_cost is None:  # (resolved here, so that every scheduler sees the model's)
            config = msgspec.structs.replace(config, chunk_context_cost=assembly.chunk_context_cost(config, model))
        if config.compute is None:  # (resolved here, so that the config says what the linears compute in)
            config = msgspec.structs.replace(config, compute=assembly.default_compute(config, model))
        self.config = config
        self.plugins = make_plugin_manager(plugins)
        self.scheduler = registry(self.plugins, "scheduler").create(config.scheduler, config)
        mc = model.config.get_text_config()
        self.max_context = getattr(mc, "max_position_embeddings", None) or math.inf
        self.vocab_size = mc.vocab_size
        self.grammars = grammar.Grammars(tokenizer, self.vocab_size)  # (structured output's compiled grammars)
        # (each made with the engine: a processor may read its tokenizer, vocabulary size, config)
        self.logits_processors = {name: factory(self) for name, factory in
                                  registry(self.plugins, "logits processor").factories.items()}
        param = next(model.parameters())
        half = assembly.half_fused(config, model)  # (a bf16 / fp16 model computed in fp32 over its weights)
        backend_name = config.attention_backend or ("cpu" if half else assembly.default_attention(param))
        backend = registry(self.plugins, "attention backend").create(backend_name, param.device)
        backend = assembly.invariant_backend(config, backend, backend_name, param.device)
        assembly.check_weights(config, model)
        assembly.check_compute(config, model)
        eviction = registry(self.plugins, "eviction policy").create(config.eviction, config)
        computed = torch.float32 if half else param.dtype
        kv_dtype = assembly.kv_cache_dtype(config, backend, backend_name, computed)
        self.cache = assembly.build_cache(config, mc, kv_dtype, param.device, self.max_context, eviction, computed)
        self.executor = StepExecutor(model, self.cache, backend)
        self.executor.static, self.async_batching = assembly.plan_static_steps(
            config, model, self.cache, backend, self.executor.compute_stream, param.device)
        # one set shared by the requests that use it (stays cached)
        self.stop_ids = frozenset(assembly.stop_ids(model, tokenizer))
        offload = registry(self.plugins, "offload backend").create(config.offload_backend, config, self.cache)
        self.preempter = Preempter(self, offload)
        self.waiting: list[Sequence] = []
        self.active: list[Sequence] = []
        self.requests: dict[str, Collector] = {}  # unfinished requests, by id
        self.step_count = 0
        self._arrivals = 0
        self.events: list[ev.Event] = []  # this step's, published once it ends
        self._woken: list[Collector] = []  # streams with tokens from the step being applied
        self._wake = anyio.Event()
        self._running = False
        self._task_group = None
        self._saved_attn = None
        self._attn_bound = False
        self._store: PackedStore | None = None  # (`EngineConfig.packed_cache`; while entered)
        self._cpu_paths: list = []
        self._forward: ForwardThread | None = None  # the one thread every forward runs on
        self._loop_alive = False
        self.errors = ErrorLog()  # plugins' failures, each distinct one logged once
        self.speculate = 0  # draft tokens a decode may get (`EngineConfig.speculative_tokens`), set once entered
        self.lookup = 0  # prompt-lookup tokens a decode may get (`EngineConfig.lookup_tokens`), set once entered

    @classmethod
    def from_pretrained(cls, model, config: EngineConfig | None = None, tokenizer=None, plugins: Iterable[object] = (),
                        dtype: torch.dtype | str | None = None):
        """`model`: a local checkpoint directory, "smollm2" (the embedded default), or a `PreTrainedModel`; `dtype`:
        the type its weights are loaded in (`core.models.load_model`: fp32 by default, the checkpoint's own half
        precision where an fp32 copy would not fit)."""
        model, tokenizer = load_model(model, tokenizer, dtype)
        return cls(model, tokenizer, config, plugins)

    # -- lifecycle -------------------------------------------------------------------------------------------

    async def __aenter__(self) -> "Engine":
        if getattr(self.model, "_jitney_engine", None) is not None:
            raise RuntimeError(f"this {type(self.model).__name__} is already served by a running jitney engine: one "
                               "engine per model object (exit the other first, or load the model again)")
        self.model._jitney_engine = self
        try:
            await self._bind()
            self.plugins.hook.jitney_engine_started(engine=self)
        except BaseException:  # nothing stays bound: the model's attention, its weights, the forward thread
            self._running = False
            self._wake.set()
            await self._unbind()
            raise
        return self

    async def _bind(self) -> None:
        self._forward = ForwardThread(self.executor)
        check = self.config.check_model
        if check:  # the model's own logits, before anything of jitney's is bound to it
            sequences = selfcheck.probe_tokens(self.vocab_size)
            reference = await self._started_on_forward_thread(selfcheck.reference_logits, self.model, sequences,
                                                              self.config.weights, self.config.kv_cache_dtype,
                                                              self.config.compute)
            # without the format's rounding too, so that a refusal can tell the format's effect from jitney's
            own = (await self._started_on_forward_thread(selfcheck.reference_logits, self.model, sequences)
                   if selfcheck.format_of(self.config, next(self.model.parameters()).dtype) else None)
        self._saved_attn = self.model.config._attn_implementation
        self.model.set_attn_implementation(ATTN_NAME)
        self._attn_bound = True
        # Packed on the thread that runs the forwards: weights packed on another thread made each step of
        # SmolLM2 at batch 1 ~30% slower (55 vs 42 ms).
        if self.config.packed_cache and next(self.model.parameters()).device.type == "cpu":
            self._store = PackedStore(cache_dir() / "packed")
        self._cpu_paths = await self._started_on_forward_thread(assembly.enter_cpu_paths, self.config, self.model,
                                                                self._store)
        if self._store is not None and self._store.mapped:
            log.info("packed weights mapped from %s (%.2f GiB)", self._store.root, self._store.mapped / 2**30)
        fused = next((p for p in self._cpu_paths if isinstance(p, cpu_layers.FusedLayers)), None)
        if fused is not None and type(self.executor.backend) is CpuPagedAttention:  # the kernel the decoder runs
            self.executor.decoder = fused.decoder
        self.speculate, self.lookup = self._plan_speculation()
        if self.speculate:  # the draft's weights packed now, on the forward thread, not in a request's first step
            await self._started_on_forward_thread(lambda: self.executor.decoder.draft)
        if check:  # the same rows through what will serve: refused here rather than wrong tokens later
            await self._started_on_forward_thread(selfcheck.check, self, reference, sequences, own)
        if self._store is not None:  # (what this start packed, once it has proven itself)
            self._store.write_in_background()
        self._task_group = anyio.create_task_group()
        await self._task_group.__aenter__()
        self._running = True
        self._loop_alive = True  # (from now: the loop task starts at the next await)
        self._task_group.start_soon(self._loop)

    async def _started_on_forward_thread(self, fn, *args):
        """`fn(*args)` on the forward thread, awaited without holding the event loop: start-up's packing, draft and
        checks take seconds, and an app enters the engine beside its own tasks (a web server's lifespan)."""
        return await anyio.to_thread.run_sync(self._forward.pool.submit(fn, *args).result)

    def _plan_speculation(self) -> tuple[int, int]:
        """Draft tokens and prompt-lookup tokens per decode (`EngineConfig.speculative_tokens`, `lookup_tokens`):
        where the one-call decoder runs decode steps that are not padded; by default not with async batching
        either (a speculative step is not chained: its next one depends on what it accepts)."""
        k, lookup = self.config.speculative_tokens, self.config.lookup_tokens
        able = self.executor.decoder is not None and self.executor.static is None and not self.cache.sliding
        for name, asked in (("speculative_tokens", k), ("lookup_tokens", lookup)):
            if asked and not able:
                log.warning("%s=%d needs the CPU's one-call decoder (fused fp32 Llama-like layers, full attention, "
                            "jitney's C++ kernels) and unpadded decode steps: decoding without it", name, asked)
        if k is None:  # (with int8 weights the draft is the model itself: no faster, docs/benchmarks.md)
            k = 0 if self.async_batching or self.config.weights in ("int8", "w8a8") else DRAFT_TOKENS
            if k and able:  # (a model near the machine's memory: the draft would leave the cache none to grow in)
                draft, cache = self.executor.decoder.draft_bytes(), self.cache.bytes_allocated
                free = available_memory(self.executor.device)
                if draft + cache + DRAFT_MARGIN > free:
                    log.warning("speculative decoding off: its int8 draft (%.1f GiB) and the KV cache (%.1f GiB) would "
                                "not fit in the memory available (%.1f GiB); speculative_tokens=8 asks for it anyway",
                                draft / 2**30, cache / 2**30, free / 2**30)
                    k = 0
        if lookup is None:
            lookup = 0 if self.async_batching else 4
        return (k, lookup) if able else (0, 0)

    def on_forward_thread(self, fn):
        """Run `fn` (torch work on the cache: swap copies) on the forward thread and wait for it. Parallel torch
        work on the event loop's thread would leave that thread an OpenMP team, and every forward after it
        would run slower (see `kernels/native.py`)."""
        if self._forward is None:
            return fn()
        return self._forward.pool.submit(fn).result()

    async def __aexit__(self, *exc_info) -> None:
        self._running = False
        for request_id in list(self.requests):
            self.abort(request_id)
        self._wake.set()
        try:
            if self._store is not None:  # (the packed copies' files finished first, unless leaving on an error)
                await anyio.to_thread.run_sync(self._store.close, exc_info[0] is None)
            await self._unbind()
        finally:
            try:
                self.plugins.hook.jitney_engine_stopped(engine=self)
            except Exception as exc:
                self.errors.report("an observer's jitney_engine_stopped", exc)

    async def _unbind(self) -> None:
        """Undo whatever `_bind` did, however far it got."""
        try:
            if self._task_group is not None:
                # The loop ends on its own now; the body's own exception (if any) propagates unchanged rather
                # than wrapped in the task group's exception group.
                await self._task_group.__aexit__(None, None, None)
        finally:
            self._task_group = None
            self._flush_events()
            if self._forward is not None:
                self._forward.shutdown()
                self._forward = None
            if self._attn_bound:
                self.model.set_attn_implementation(self._saved_attn)
                self._attn_bound = False
            self.executor.decoder = None
            if self._store is not None:
                self._store.close()
                self._store = None
            for path in reversed(self._cpu_paths):
                path.__exit__(None, None, None)
            self._cpu_paths = []
            self.model._jitney_engine = None

    @property
    def healthy(self) -> bool:
        """Whether the engine is entered and its step loop runs (what a server's /health reports)."""
        return self._running and self._loop_alive

    # -- the public API --------------------------------------------------------------------------------------

    def submit(self, request: Request) -> Collector:
        """Validate and queue a request; a bad request raises here, before anything is allocated."""
        if not self._running:
            raise RuntimeError("the engine is not running: use `async with engine:` first")
        request_id = request.request_id or uuid.uuid4().hex[:16]
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if request.params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer to read the text; give the engine one, or use stop_token_ids")
        bias = request.params.logit_bias
        if bias and max(bias) >= self.vocab_size:
            raise ValueError(f"logit_bias names token {max(bias)}; the model's vocabulary has {self.vocab_size}")
        chain = processors.chain(request.params, self.logits_processors)
        prompt_ids = self._encode(request.prompt)
        total = len(prompt_ids) + request.params.max_new_tokens
        if total > self.max_context:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) plus max_new_tokens ({request.params.max_new_tokens}) exceeds "
                f"the model's context of {self.max_context} tokens"
            )
        if self.cache.blocks_needed(request_id, total) > self.cache.num_blocks:
            raise ValueError(
                f"request needs {total} tokens of cache; the whole cache holds "
                f"{self.cache.num_blocks * self.cache.block_size} (raise num_blocks or lower max_new_tokens)"
            )
        stop = _NO_STOPS if request.params.ignore_eos else (
            frozenset(request.params.stop_token_ids) if request.params.stop_token_ids else self.stop_ids)
        seq = Sequence(request, prompt_ids, stop, self._arrivals, request_id=request_id, now=self.clock())
        # Further samples wait on the first one and fork from it once the prompt is in the cache.
        seq.forks = [Sequence(request, prompt_ids, stop, self._arrivals, seq.collector, i, request_id, seq.t_queued)
                     for i in range(1, request.params.n)]
        for sample in (seq, *seq.forks):
            sample.set_processors(chain)
        self._arrivals += 1
        self.requests[request_id] = seq.collector
        self.waiting.append(seq)
        self.events.append(ev.RequestQueued(t=seq.t_queued, step=self.step_count + 1, request_id=seq.request_id,
                                             prompt_tokens=len(prompt_ids), max_new_tokens=request.params.max_new_tokens))
        self._wake.set()
        return seq.collector

    def stream(self, request: Request) -> TokenStream:
        """Submit `request` and stream its tokens: ``async for token in engine.stream(req)``.

        Leaving the loop early (break, cancellation) aborts the request and frees its cache.
        """
        return TokenStream(self, self.submit(request))

    async def generate(self, request: Request) -> Completion:
        """Submit `request` and wait for its completion."""
        async with self.stream(request) as tokens:
            async for _ in tokens:
                pass
            return tokens.completion()

    async def chat(self, messages: list[dict], params: SamplingParams | None = None,
                   tools: list[dict] | None = None) -> Completion:
        """Complete a conversation (OpenAI's message shapes: text or text parts, tool-call turns, tool results) under
        the tokenizer's chat template, as the server applies it, `tools` offered where given (read calls back with
        `jitney.core.chat.parse_tool_calls(completion.text)`). The template is applied off the event loop."""
        ids = await anyio.to_thread.run_sync(chats.prompt_ids, self.tokenizer, messages, tools)
        return await self.generate(Request(ids, params or SamplingParams()))

    def abort(self, request_id: str) -> bool:
        """Cancel a request (all its samples), or one sample by the id its events carry (``<id>#<i>`` for
        sample i > 0), and return its blocks to the pool at once. False when nothing by that id is running.

        Safe while its forward runs: blocks are only handed out again when the next step is scheduled, after
        that forward has finished; its sampled token is then dropped.
        """
        collector = self.requests.get(request_id)
        if collector is not None:
            samples = collector.samples
        else:
            parent, _, index = request_id.rpartition("#")
            collector = self.requests.get(parent)
            if collector is None or not index.isdigit() or not 0 < int(index) < len(collector.samples):
                return False
            samples = [collector.samples[int(index)]]
        for seq in samples:
            if not seq.status.done:
                self._finish(seq, "cancelled")
        return True

    @property
    def num_free_blocks(self) -> int:
        return self.cache.num_free_blocks

    def memory(self) -> MemoryUse:
        """The bytes this engine holds, by part: the model's weights, jitney's packed copies, the draft, the LM
        head's screen, the KV cache (`core.memory`). The packed parts are there once the engine is entered."""
        return memory_use(self.model, self._cpu_paths, self.cache)

    # -- the step loop ---------------------------------------------------------------------------------------

    async def _loop(self) -> None:
        try:
            while self._running or self.requests:
                if not (self.waiting or self.active or self.preempter.offloaded):
                    self._flush_events()
                    await self._wake.wait()
                    self._wake = anyio.Event()
                    continue
                try:
                    await self._step()
                except Exception as exc:  # a bug of the engine's own: what was in flight fails, serving goes on
                    log.exception("a step failed outside the forward pass")
                    self._fail(self._in_flight(), f"internal error: {type(exc).__name__}: {exc}")
                    self._flush_events()
                    await anyio.sleep(0)  # (a step that keeps failing still lets the event loop run)
        finally:
            self._loop_alive = False

    async def _step(self) -> None:
        """Schedule a batch and run it. With async batching, while a step of decodes runs, the next one (the
        same requests, one token further) is prepared, launched as soon as the tokens are known, and the
        finished step's tokens are handed out while it runs; this goes on until the scheduler is needed
        again (a request waits, or a row is not a plain decode)."""
        t0 = self.clock()
        marks = (self.cache.blocks_demoted, self.preempter.total)
        try:
            batch = self._schedule()
        except PluginFault as fault:
            self._scheduler_failed(fault)
            return
        entries = batch.entries
        admitted = {s.request_id for s, _ in entries if s.status is RequestStatus.PENDING}
        if admitted:
            self.waiting = [s for s in self.waiting if s.request_id not in admitted]
        queried = hit = 0
        for seq, n in entries:
            if seq.status is RequestStatus.PENDING:
                seq.status = RequestStatus.PREFILLING
                bisect.insort(self.active, seq, key=lambda s: s.arrival)
                queried += seq.num_tokens
                hit += seq.num_computed
                self.events.append(ev.PrefillStarted(t=t0, step=self.step_count + 1, request_id=seq.request_id,
                                                     cached_tokens=seq.num_computed))
        prefill = prompt_tokens(entries)  # (counted now: once applied, a prompt's last chunk looks like a decode)
        forward = self._forward
        try:
            drafts = self._speculation(entries) if self.speculate else 0
            guesses = (lookup.guesses(entries, self.lookup, self.config.max_batch_tokens, self.cache)
                       if self.lookup and not drafts and not self.preempter.offloaded else None)
            running = forward.submit(self.executor.prepare(entries, speculate=drafts, proposals=guesses))
        except Exception as exc:
            self._forward_failed(entries, exc)
            return
        ran_ahead = False
        while True:
            try:
                ahead = self._prepare_ahead(entries) if self.async_batching and not (drafts or guesses) else None
            except Exception:  # the scheduler will take the next step instead
                log.exception("preparing the next step ahead failed")
                ahead = None
            chained = None if ahead is None else forward.then(running, ahead[1], ahead[2])
            try:
                tokens, forward_s, row_errors, row_logprobs = await forward.wait(running)
            except Exception as exc:  # a failing forward fails its batch, not the engine
                self._forward_failed(entries, exc)
                return
            for i, why in row_errors.items():  # (its token, 0, is dropped: the request has ended)
                if not entries[i][0].status.done:
                    self._finish(entries[i][0], "error", why)
            if ahead is not None:
                next_entries, prepared, rows = ahead
                if chained is None:  # the step ended before the next one was ready: start it from here
                    self.executor.set_tokens(prepared, [tokens[i][0] for i in rows])
                    chained = forward.submit(prepared)
                running = chained
            # A request that ends here still has a row in the step now running: its blocks may be handed
            # out again at once, since that row's writes land before any later step writes for a new owner.
            speculative = drafts or guesses
            if guesses:
                lookup.learn(entries, guesses, tokens)
            if row_logprobs:
                _keep_logprobs(entries, row_logprobs, speculative)
            self._apply_runs(entries, tokens) if speculative else self._apply(entries, tokens)
            accepted = sum(len(run) - 1 for run in tokens) if speculative else 0
            proposed = sum(map(len, guesses)) if guesses else drafts * len(entries)
            self._step_completed(entries, t0, marks, queried, hit, prefill, ran_ahead, forward_s, proposed, accepted)
            if ahead is None:
                return
            # (a step prepared ahead only decodes: `_prepare_ahead`)
            entries, t0, queried, hit, prefill, ran_ahead = next_entries, self.clock(), 0, 0, 0, True
            marks = (self.cache.blocks_demoted, self.preempter.total)

    @property
    def _least_proposals(self) -> int:
        # one proposal each did not pay for its draft pass (3 SmolLM2 streams: 57-69 vs 63-72 tok/s), unless
        # that is what was asked for
        return min(2, self.speculate)

    def _speculation(self, entries: list[tuple[Sequence, int]]) -> int:
        """Draft tokens for each request of this step, their cache reserved; 0 for a plain step. Only where every
        entry decodes one greedy sample, nothing waits for the cache, and the rows with their proposals (at
        least two each) stay within `speculative_max_rows` and the token budget; never past a request's last
        token. Not where a row is held to a grammar: the draft proposes without its mask (4 SmolLM2 JSON-schema
        requests accepted 19 of its 170 proposals and ran at half the speed); prompt lookup takes those steps."""
        if self.waiting or self.preempter.offloaded:
            return 0
        cfg, count, least = self.config, len(entries), self._least_proposals
        k = min(self.speculate, cfg.speculative_max_rows // count - 1, cfg.max_batch_tokens // count - 1)
        if k < least or not greedy_decodes(entries) or any(seq.params.grammar is not None for seq, _ in entries):
            return 0
        k = min(k, *(seq.max_new_tokens - len(seq.output_ids) - 1 for seq, _ in entries))
        if k < least:
            return 0
        for seq, _ in entries:
            if not self.cache.reserve(seq.request_id, seq.num_tokens + k):
                return 0
        return k

    def _prepare_ahead(self, entries: list[tuple[Sequence, int]]) -> tuple[list[tuple[Sequence, int]], PreparedStep, list[int]] | None:
        """While `entries` run, prepare the step after: every row that decodes now, one token further (its
        token set once sampled), unless something needs the scheduler first. Returns the step's entries, its
        inputs, and the row of the running step each entry's token comes from."""
        if not self._running or self.waiting or self.preempter.offloaded:
            return None
        rows = []
        for i, (seq, n) in enumerate(entries):
            if seq.status.done:
                continue
            if n != 1 or seq.num_computed + 1 != seq.num_tokens or seq.forks or seq.needs_logits:
                return None  # (a row that reads its whole logits is shaped by the token the running step samples)
            if len(seq.output_ids) + 1 < seq.params.max_new_tokens:  # not ending on length this step
                if not self.cache.reserve(seq.request_id, seq.num_tokens + 1):
                    return None
                rows.append(i)
        if not rows or (self.speculate and (1 + self._least_proposals) * len(rows) <= self.config.speculative_max_rows):
            return None  # (few enough rows to speculate: the next step goes through `_speculation`)
        ahead = [(entries[i][0], 1) for i in rows]
        return ahead, self.executor.prepare(ahead, ahead=True), rows

    def _forward_failed(self, entries: list[tuple[Sequence, int]], exc: Exception) -> None:
        log.exception("forward pass failed", exc_info=exc)
        self._fail([seq for seq, _ in entries], f"{type(exc).__name__}: {exc}")

    def _in_flight(self) -> list[Sequence]:
        """Every request the engine holds: running, waiting, offloaded."""
        return [*self.active, *self.waiting, *self.preempter.offloaded]

    def _fail(self, seqs: Iterable[Sequence], error: str) -> None:
        """End each of `seqs` that has not ended yet as failed with `error`, its cache freed."""
        for seq in seqs:
            if not seq.status.done:
                self._finish(seq, "error", error)

    def _step_completed(self, entries: list[tuple[Sequence, int]], t0: float, marks: tuple[int, int], queried: int,
                        hit: int, prefill: int, ahead: bool, forward_s: float, drafted: int, accepted: int) -> None:
        """Publish the step's events, ending with its `StepCompleted`; `prefill`: its prompt tokens
        (`prompt_tokens`, counted before the step was applied)."""
        self.step_count += 1
        self.events.append(ev.StepCompleted(
            t=self.clock(), step=self.step_count, requests=len(entries), prefill_tokens=prefill,
            decode_tokens=sum(n for _, n in entries) - prefill, forward_s=forward_s,
            step_s=self.clock() - t0, waiting=len(self.waiting), running=len(self.active),
            free_blocks=self.cache.num_free_blocks, total_blocks=self.cache.num_blocks,
            cached_blocks=self.cache.num_cached_blocks,
            prefix_query_tokens=queried, prefix_hit_tokens=hit, blocks_demoted=self.cache.blocks_demoted - marks[0],
            preemptions=self.preempter.total - marks[1], offloaded=len(self.preempter.offloaded), ahead=ahead,
            draft_tokens=drafted, accepted_tokens=accepted, batch=tuple((s.request_id, n) for s, n in entries),
        ))
        self._flush_events()

    def _schedule(self) -> Batch:
        return self.preempter.schedule(self.scheduler, self.config.scheduler)

    def _scheduler_failed(self, fault: PluginFault) -> None:
        """Fail the requests a faulty schedule concerned — those its batch named, else every request it was
        given (it produced no step for them) — and free their cache; requests submitted later still run."""
        self._fail(batch_requests(fault.batch) or [*self.active, *self.waiting], str(fault))
        self._flush_events()

    def _apply(self, entries: list[tuple[Sequence, int]], tokens: list[list[int] | None]) -> None:
        # Once per token of every running request: kept to the objects a decode needs, and a decode's token
        # taken here rather than through `_emit` (a call per request; measured cold, as after a real forward,
        # each object touched costs about as much as the work on it).
        now = self.clock()
        step = self.step_count + 1
        cache = self.cache
        bs = cache.block_size
        sliding = cache.sliding
        decoding = RequestStatus.DECODING
        events = self.events
        woken = self._woken
        generated = ev.TokensGenerated
        for (seq, n), drawn in zip(entries, tokens):
            status = seq.status
            if status is decoding and n == 1 and not sliding:  # the common case: `_emit`, inlined
                computed = seq.num_computed = seq.num_computed + 1
                if not computed % bs:  # a block completed: hash it
                    cache.commit(seq)
                tok = drawn[0]  # type: ignore[index]
                out = seq.output_ids
                out.append(tok)
                count = len(out)
                events.append(generated(t=now, step=step, request_id=seq.request_id, tokens=1, total=count))
                woken.append(seq.collector)  # (its consumer reads the token from `output_ids`)
                if tok in seq.stop_ids or (seq.stop_strings and self._hit_stop_string(seq)):
                    self._finish(seq, "stop")
                elif count >= seq.max_new_tokens:
                    self._finish(seq, "length")
                continue
            if status is not decoding and status.done:  # aborted while its forward ran
                continue
            computed = seq.num_computed = seq.num_computed + n
            if computed // bs != (computed - n) // bs:  # a block completed: hash it
                cache.commit(seq)
            if sliding:
                cache.slide(seq.request_id, computed)
            if status is decoding:
                self._emit(seq, drawn[0], now)
                continue
            events.append(ev.PrefillChunk(t=now, step=step, request_id=seq.request_id, tokens=n, computed=computed,
                                          recompute=computed - n < seq.computed_before))
            if drawn is not None:
                self._first_tokens(seq, drawn, now)
        self._wake_streams()

    def _apply_runs(self, entries: list[tuple[Sequence, int]], runs: list[list[int]]) -> None:
        """A speculative step's tokens (every entry a greedy decode: `_speculation`), each taken as a decode step
        would take it: the slot before it computed (the step ran the token before it there), then handed out;
        a request may end at any of them."""
        now = self.clock()
        bs = self.cache.block_size
        for (seq, _), run in zip(entries, runs):
            for tok in run:
                if seq.status.done:  # aborted while its forward ran, or ended on the token before
                    break
                computed = seq.num_computed = seq.num_computed + 1
                if computed % bs == 0:  # a block completed: hash it
                    self.cache.commit(seq)
                self._emit(seq, tok, now)
        self._wake_streams()

    def _first_tokens(self, seq: Sequence, drawn: list[int], now: float) -> None:
        """A prompt is done (first computed, or again after a soft reset): its samples fork and take their
        tokens."""
        if seq.forks:
            forks, seq.forks = seq.forks, []
            for child, tok in zip(forks, drawn[1:]):
                if child.status.done:  # aborted on its own before its prompt was done
                    continue
                self._fork(seq, child)
                self._first_token(child, now)
                self._emit(child, tok, now)
        seq.status = RequestStatus.DECODING
        self._first_token(seq, now)
        self._emit(seq, drawn[0], now)

    def _first_token(self, seq: Sequence, now: float) -> None:
        if seq.t_first_token is None:
            seq.t_first_token = now
            self.events.append(ev.FirstToken(t=now, step=self.step_count + 1, request_id=seq.request_id,
                                             ttft=now - seq.t_queued))

    def _wake_streams(self) -> None:
        """Wake the consumers of this step's tokens (a request's samples share one: woken again, it is awake)."""
        for collector in self._woken:
            collector.ready.set()
        self._woken = []

    def _fork(self, parent: Sequence, child: Sequence) -> None:
        """Start a further sample on the parent's prompt: share its full blocks, copy the partial one."""
        if self.cache.fork(parent.request_id, child.request_id, parent.num_computed):
            child.num_computed = parent.num_computed
            child.status = RequestStatus.DECODING
            bisect.insort(self.active, child, key=lambda s: s.arrival)
        else:  # no block for the copy: the sample queues and prefills on its own (sharing cached blocks)
            bisect.insort(self.waiting, child, key=lambda s: s.arrival)

    def _emit(self, seq: Sequence, tok: int, now: float) -> None:
        """Record a sampled token, hand it to the consumer, and finish the sample on a stop token or length."""
        out = seq.output_ids
        out.append(tok)
        count = len(out)
        self.events.append(ev.TokensGenerated(t=now, step=self.step_count + 1, request_id=seq.request_id, tokens=1,
                                              total=count))
        woken = self._woken
        if not woken or woken[-1] is not seq.collector:  # (a speculative step emits a few tokens in a row)
            woken.append(seq.collector)
        if tok in seq.stop_ids or (seq.stop_strings and self._hit_stop_string(seq)):
            self._finish(seq, "stop")
        elif count >= seq.max_new_tokens:
            self._finish(seq, "length")

    def _hit_stop_string(self, seq: Sequence) -> bool:
        # Decode only a window at the end: enough for the longest stop string plus the new token's text.
        window = max(map(len, seq.stop_strings)) + 16
        tail = self.decode(seq.output_ids[-window:])
        return cut_at_stop(tail, seq.stop_strings)[1]

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        self.cache.release(seq.request_id)
        if seq in self.active:
            self.active.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        else:
            self.preempter.forget(seq)
        seq.finish_reason, seq.error = reason, error
        seq.status = {"error": RequestStatus.FAILED, "cancelled": RequestStatus.CANCELLED}.get(reason, RequestStatus.FINISHED)
        now = self.clock()
        if error is not None:
            self.events.append(ev.RequestFailed(t=now, step=self.step_count + 1, request_id=seq.request_id,
                                                error=error))
        self.events.append(ev.RequestFinished(step=self.step_count + 1,
            t=now, request_id=seq.request_id, finish_reason=reason, prompt_tokens=len(seq.prompt_ids),
            output_tokens=len(seq.output_ids), latency=now - seq.t_queued,
        ))
        for child in seq.forks:  # samples that never forked end with their parent
            if not child.status.done:
                self._finish(child, reason, error)
        seq.forks = []
        seq.collector.end()
        if seq.collector.done:
            self.requests.pop(seq.parent_id, None)

    def _flush_events(self) -> None:
        if not self.events:
            return
        batch, self.events = self.events, []
        observe = getattr(self.scheduler, "on_events", None)
        if observe is not None:
            try:
                observe(batch)
            except Exception as exc:  # its view of these requests is now unknown: they fail, others go on
                self.errors.report(f"scheduler {self.config.scheduler!r} (on_events)", exc)
                named = {getattr(e, "request_id", None) for e in batch}  # (their events go out with the next batch)
                self._fail([s for s in self._in_flight() if s.request_id in named],
                           f"scheduler {self.config.scheduler!r} failed in on_events: {type(exc).__name__}: {exc}")
        notify_observers(self.plugins, self.errors, batch, self)

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids or give the engine a tokenizer")
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids outside the vocabulary (size {self.vocab_size}): {bad[:5]}")
        if not ids:
            raise ValueError("the prompt is empty")
        return ids

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True) if self.tokenizer is not None else ""


_NO_STOPS: frozenset[int] = frozenset()


def _keep_logprobs(entries: list[tuple[Sequence, int]], row_logprobs: dict[int, list], runs: bool) -> None:
    """Note the logprobs of a step's tokens on their samples, before the tokens are handed out: a prompt that is
    done gives its first sample the first, and the samples forking from it the others, in order; in a speculative
    step (`runs`) each entry's are those of its run of tokens."""
    for i, logprobs in row_logprobs.items():
        seq = entries[i][0]
        if runs:
            seq.logprobs.extend(logprobs)
            continue
        for sample, lp in zip([seq, *seq.forks], logprobs):
            if sample.logprobs is not None:
                sample.logprobs.append(lp)


def prompt_tokens(entries: list[tuple[Sequence, int]]) -> int:
    """The tokens of a step's entries that are prompt chunks: every entry of a request still in its prompt,
    a chunk of one token included (its `PrefillChunk` says so too); the rest are decodes, one token a request
    (a speculative step's proposals are rows of that one entry, not prompt)."""
    decoding = RequestStatus.DECODING
    return sum(n for seq, n in entries if seq.status is not decoding)
