"""The step executor: one flat forward over every scheduled token, then sampling."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial

import anyio
import torch

from jitney.cache.manager import CacheManager
from jitney.core.graphs import StaticDecoder, StaticDecodeStep
from jitney.core.request import SamplingParams
from jitney.core.processors import Row
from jitney.core.sampling import Logprobs, greedy_run, sample
from jitney.core.sequence import Sequence
from jitney.kernels.base import STEP_KWARG, AttentionBackend, StepInputs, int_tensor


@dataclass
class PreparedStep:
    """One step's inputs, built before the forward runs."""

    num_entries: int
    input_ids: torch.Tensor | None  # None (like positions, keep and step) for a static step
    positions: torch.Tensor | None
    keep: torch.Tensor | None
    step: StepInputs | None
    sampled_entries: list[int]
    samples_per_entry: list[int]
    """How many tokens each sampled entry draws from its row: 1, or n when its prompt is done and it forks."""
    params: list[SamplingParams]
    generators: list[torch.Generator | None]
    static: StaticDecodeStep | None = None
    """Set when the step runs as a padded static decode step (its inputs live in the step's buffers)."""
    new_blocks: list[list[int]] | None = None
    """Blocks reserved for this step and not zeroed yet (per group): the forward zeroes them first."""
    speculate: int = 0
    """Tokens the draft proposes after each row's (a decode-only step of greedy rows; see
    `FusedDecoder.speculate`): each sampled entry then gets one to ``speculate + 1`` tokens."""
    proposals: list[list[int]] | None = None
    """Guesses at each entry's next tokens (a decode-only step of greedy rows; `core/lookup`, checked by
    `FusedDecoder.check`): each entry then gets one to ``len + 1`` tokens."""
    rows: list[Row | None] | None = None
    """Per sample (as `params`), what its logits processors read (None for a row without any); None when no row
    of the step needs its whole logits (`Sequence.needs_logits`)."""


class StepExecutor:
    """Runs a batch through the model. Called on a worker thread, never on the event loop's."""

    def __init__(self, model: torch.nn.Module, cache: CacheManager, backend: AttentionBackend):
        self.model = model
        self.cache = cache
        self.backend = backend
        # Padded decode steps, set by the engine once it has planned them (their graphs use this compute stream).
        self.static: StaticDecoder | None = None
        # The whole model in one call for every step (`cpu_layers.FusedDecoder`), set by the engine while
        # the model's layers are fused and the attention backend is the one it computes.
        self.decoder = None
        self.device = next(model.parameters()).device
        # On CUDA, inputs are copied on one stream and the forward runs on another, so that the next step's
        # inputs can be written while this one runs (async batching).
        cuda = self.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.device) if cuda else None
        self.compute_stream = torch.cuda.Stream(self.device) if cuda else None
        self.forward_s = 0.0  # time of the latest forward + sampling
        self.sampling_s = 0.0  # time in choosing tokens from whole logits (processors, draws, logprobs), all steps
        self.row_errors: dict[int, str] = {}  # the latest forward's entries whose sampling failed, and why
        self.row_logprobs: dict[int, list[Logprobs]] = {}  # its entries' logprobs (one per sample), where asked for

    def prepare(self, entries: list[tuple[Sequence, int]], ahead: bool = False, speculate: int = 0,
                proposals: list[list[int]] | None = None) -> PreparedStep:
        """Build the step's input tensors, on the event loop's thread: after this, the forward reads nothing
        that the loop may change (an abort can free a request's blocks while its forward runs).

        `ahead`: every entry is a decode of the token that the running step is still sampling (position
        `num_tokens`); its token ids are given later with `set_tokens`. `speculate`, `proposals`: see
        `PreparedStep` (the caller has reserved each entry's cache for that many tokens more).
        """
        with torch.cuda.stream(self.copy_stream) if self.copy_stream is not None else nullcontext():
            return self._prepare(entries, ahead, speculate, proposals)

    def _prepare(self, entries: list[tuple[Sequence, int]], ahead: bool, speculate: int,
                 proposals: list[list[int]] | None) -> PreparedStep:
        prepared = self._build(entries, ahead)
        prepared.new_blocks = self.cache.take_new_blocks()
        prepared.speculate = speculate
        prepared.proposals = proposals
        return prepared

    def _build(self, entries: list[tuple[Sequence, int]], ahead: bool) -> PreparedStep:
        seqs, ids, positions, qlens, ctx, sampled_rows, sampled_entries, num_decodes = (
            self._decode_rows(entries, ahead) or self._mixed_rows(entries, ahead))
        cache = self.cache
        request_ids = [s.request_id for s in seqs]
        # every row a decode that samples once (no forks)
        plain = len(sampled_entries) == len(entries) == len(ids) and not any(s.forks for s in seqs)
        if plain:
            samplers = seqs
            params, generators = [s.params for s in seqs], [s.generator for s in seqs]
            samples_per_entry = [1] * len(entries)
        else:
            groups = [[entries[i][0]] + entries[i][0].forks for i in sampled_entries]
            samplers = [s for group in groups for s in group]
            params, generators = [s.params for s in samplers], [s.generator for s in samplers]
            samples_per_entry = [len(group) for group in groups]
        rows = _rows(samplers)
        if self.static is not None and plain:  # the step runs at a padded shape (decodes keep their order)
            return PreparedStep(
                num_entries=len(entries), input_ids=None, positions=None, keep=None, step=None,
                sampled_entries=sampled_entries, samples_per_entry=samples_per_entry, params=params,
                generators=generators, rows=rows, static=self.static.prepare(
                    ids, positions, [cache.block_tables(request_ids, g) for g in range(len(cache.groups))]),
            )
        tables = [cache.block_table_tensor(request_ids, g).to(self.device) for g in range(len(cache.groups))]
        pos = int_tensor(positions, self.device)
        step = StepInputs(
            query_lens=qlens, context_lens=ctx, num_decodes=num_decodes, positions=pos,
            block_tables=tables, group_of_layer=cache.group_of_layer, block_size=cache.block_size,
            padding_slot=cache.padding_slot, keys=cache.keys, values=cache.values,
        )
        return PreparedStep(
            num_entries=len(entries), input_ids=int_tensor(ids, self.device)[None], positions=pos,
            keep=int_tensor(sampled_rows or [len(ids) - 1], self.device), step=step,
            sampled_entries=sampled_entries, samples_per_entry=samples_per_entry, params=params,
            generators=generators, rows=rows,
        )

    @staticmethod
    def _decode_rows(entries: list[tuple[Sequence, int]], ahead: bool) -> tuple | None:
        """The rows of a step where every entry decodes (the common step at many requests), in a few list
        comprehensions instead of `_mixed_rows`' loop; None when an entry is not a decode."""
        seqs = [s for s, n in entries if n == 1]
        if len(seqs) != len(entries):
            return None
        lengths = [len(s.prompt_ids) + len(s.output_ids) for s in seqs]
        if ahead:
            positions, ids = lengths, [0] * len(seqs)
        else:
            positions = [s.num_computed for s in seqs]
            if [p + 1 for p in positions] != lengths or any(p < len(s.prompt_ids) for p, s in zip(positions, seqs)):
                return None  # a one-token prefill chunk (the prompt's last token, perhaps: not a decode either)
            ids = [(s.output_ids or s.prompt_ids)[-1] for s in seqs]  # a decode runs the latest token
        ctx = [p + 1 for p in positions]
        every = list(range(len(seqs)))
        return seqs, ids, positions, [1] * len(seqs), ctx, every, every, len(seqs)

    @staticmethod
    def _mixed_rows(entries: list[tuple[Sequence, int]], ahead: bool) -> tuple:
        # Decodes go first: the backend batches them in one call. A one-token chunk of a prompt is not a decode: it
        # stays a prefill chunk, so that a prompt's rows go through the prefill kernel however the prompt is split
        # (the two kernels sum in different orders: its logits would depend on the split, see docs/reliability.md).
        decode = [ahead or (n == 1 and s.num_computed >= len(s.prompt_ids)) for s, n in entries]
        order = sorted(range(len(entries)), key=lambda i: not decode[i])
        ids: list[int] = []
        positions: list[int] = []
        qlens, ctx, sampled_rows, sampled_entries = [], [], [], []
        for i in order:
            seq, n = entries[i]
            start = seq.num_tokens if ahead else seq.num_computed
            ids.extend([0] if ahead else seq.tokens(start, start + n))
            positions.extend(range(start, start + n))
            qlens.append(n)
            ctx.append(start + n)
            if ahead or start + n == seq.num_tokens:
                sampled_rows.append(len(ids) - 1)
                sampled_entries.append(i)
        return [entries[i][0] for i in order], ids, positions, qlens, ctx, sampled_rows, sampled_entries, sum(decode)

    def set_tokens(self, prepared: PreparedStep, token_ids: list[int]) -> None:
        """Give a step prepared `ahead` its input tokens, one per entry in entry order."""
        with torch.cuda.stream(self.copy_stream) if self.copy_stream is not None else nullcontext():
            ids = int_tensor(token_ids, self.device)
            if prepared.static is not None:
                prepared.static.input_ids[0, : len(token_ids)].copy_(ids)
            else:
                prepared.input_ids[0].copy_(ids)

    def zero_new_blocks(self, prepared: PreparedStep) -> None:
        """Zero the step's new blocks (on the forward thread, before the forward reads or writes them), where
        the attention backend reads whole blocks."""
        if prepared.new_blocks and getattr(self.backend, "reads_unwritten_slots", True):
            self.cache.zero_blocks(prepared.new_blocks)
            prepared.new_blocks = None

    def forward(self, prepared: PreparedStep, started: Callable[[], None]) -> list[list[int] | None]:
        """Run the model; return, per entry, its sampled tokens (one per sample; a speculative step's, one or more
        in order) or None (prompt not done).

        `started()` is called once the step is under way and about to leave Python for a while (just before the
        one-call decoder; at once on other paths): see `ForwardThread`."""
        t0 = time.perf_counter()
        p = prepared
        self.row_errors, self.row_logprobs = {}, {}
        stream = self.compute_stream
        if stream is not None:
            stream.wait_stream(self.copy_stream)
            stream.wait_stream(torch.cuda.default_stream(self.device))
        with torch.inference_mode(), torch.cuda.stream(stream) if stream is not None else nullcontext():
            self.zero_new_blocks(p)
            result: list[list[int] | None] = [None] * p.num_entries
            if p.speculate or p.proposals:
                verify = None if p.rows is None else partial(self._verified, p)
                d = self.decoder
                runs = (d.speculate(p.input_ids, p.positions, p.step, p.speculate, started, verify) if p.speculate
                        else d.check(p.input_ids, p.positions, p.step, p.proposals, started, verify))
                for i, run in zip(p.sampled_entries, runs):
                    result[i] = run
            else:
                self._forward(p, started, result)
            if stream is not None:
                stream.synchronize()  # the step is over on the device too: its blocks may be handed out again
        self.forward_s = time.perf_counter() - t0
        return result

    def _forward(self, p: PreparedStep, started: Callable[[], None], result: list[list[int] | None]) -> None:
        if (self.decoder is not None and p.static is None and p.sampled_entries and len(p.params) == len(p.sampled_entries)
                and p.rows is None and all(s.greedy for s in p.params)):
            tokens, errors, logprobs = self._decoded(p, started, greedy=True).tolist(), {}, {}  # (the head's screen)
        else:
            logits, argmax = self.logits(p, started)
            if not p.sampled_entries:
                return
            if len(p.params) > len(p.sampled_entries):  # forking rows draw several tokens from one row
                logits = logits.repeat_interleave(torch.tensor(p.samples_per_entry, device=logits.device), dim=0)
            t0 = time.perf_counter()
            tokens, errors, logprobs = sample(logits, p.params, p.generators, argmax, p.rows)
            self.sampling_s += time.perf_counter() - t0
        start = 0
        for i, count in zip(p.sampled_entries, p.samples_per_entry):
            result[i] = tokens[start : start + count]
            if logprobs and start in logprobs:  # (a request's samples all ask for them, or none)
                self.row_logprobs[i] = [logprobs[r] for r in range(start, start + count) if r in logprobs]
            if errors:
                why = next((errors[r] for r in range(start, start + count) if r in errors), None)
                if why is not None:
                    self.row_errors[i] = why
            start += count

    def _verified(self, p: PreparedStep, logits: torch.Tensor, proposals: list[list[int]]) -> list[list[int]]:
        """A speculative step's tokens where some of its rows read their whole logits (`PreparedStep.rows`): each
        such row's chosen under its processors, position after position (`greedy_run`), with its logprobs; the
        others' as the checking pass would choose them. A row whose processors fail fails its request alone."""
        t0 = time.perf_counter()
        best = self.decoder.argmax(logits)
        runs, start = [], 0
        for e, (i, guess) in enumerate(zip(p.sampled_entries, proposals)):
            span = slice(start, start + len(guess) + 1)  # (its token's row, then one a guess)
            start = span.stop
            row, k = p.rows[e], p.params[e].logprobs
            try:
                run, logprobs = greedy_run(logits[span], best[span], guess, row, k)
            except Exception as exc:
                run, self.row_errors[i] = [0], f"sampling failed: {type(exc).__name__}: {exc}"
                logprobs = []
            runs.append(run)
            if logprobs:
                self.row_logprobs[i] = logprobs
        self.sampling_s += time.perf_counter() - t0
        return runs

    def logits(self, p: PreparedStep, started: Callable[[], None] = lambda: None) -> tuple[torch.Tensor, Callable | None]:
        """The step's logits at its sampled rows, by the path that serves it (padded static step, the CPU's
        one-call decoder, or the model with jitney's attention), and that path's argmax if it has its own."""
        if p.static is not None:
            started()
            return self.static.forward(p.static), None
        if self.decoder is not None:
            return self._decoded(p, started), self.decoder.argmax
        started()
        logits = self.model(
            input_ids=p.input_ids, position_ids=p.positions[None], use_cache=False, logits_to_keep=p.keep,
            **{STEP_KWARG: self.backend.prepare(p.step)},
        ).logits[0]
        return logits, None

    def _decoded(self, p: PreparedStep, started: Callable[[], None], greedy: bool = False) -> torch.Tensor:
        """The one-call decoder's logits at the step's sampled rows, or with `greedy` their greedy tokens."""
        if p.step.num_decodes == len(p.step.query_lens):
            return self.decoder(p.input_ids, p.positions, p.step, started, greedy)
        # (no LM head at all for a step that samples nothing: chunks of prompts that go on)
        keep = p.keep.tolist() if p.sampled_entries else []
        return self.decoder.step(p.input_ids, p.positions, p.step, keep, started, greedy)


class ForwardThread:
    """The one thread every forward runs on, with decode steps chained on it.

    `submit` runs a step; `then` queues a step prepared ahead behind the running one: this thread gives it the
    tokens the running step samples and starts it the moment that step ends, instead of the event loop doing so
    once it has woken up (two thread wake-ups: ~1.2 ms between batch-1 steps of ~25–35 ms on this machine's
    VMs). The ended step's tokens are handed to the loop only once the next step has left Python: handed out
    at once, the loop's work on them held the GIL while the next step's Python start waited (0.6 ms between
    steps, 0.25 ms as kept). A step's future gives ``(tokens per entry, seconds in the forward, {entry: why}
    for entries whose sampling failed)``.
    """

    def __init__(self, executor: StepExecutor):
        self.executor = executor
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="jitney-forward")
        self._lock = threading.Lock()
        self._running: Future | None = None  # the step on the thread, or next to start there
        self._queued: tuple[PreparedStep, list[int], Future] | None = None

    def submit(self, prepared: PreparedStep) -> Future:
        done = _started_future()
        with self._lock:
            self._running = done
        self.pool.submit(self._run, prepared, done, None)
        return done

    def then(self, running: Future, prepared: PreparedStep, rows: list[int]) -> Future | None:
        """Queue `prepared` (entry i's token: what `running` samples for its entry ``rows[i]``) to start as
        `running` ends; None when `running` has ended already (the caller submits it instead)."""
        with self._lock:
            if self._running is not running or self._queued is not None:
                return None
            done = _started_future()
            self._queued = (prepared, rows, done)
            return done

    async def wait(self, done: Future) -> tuple[list[list[int] | None], float]:
        """A step's result, awaited on the event loop: on asyncio the future wakes the loop itself; other
        event loops wait for it on a thread of their own."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return await anyio.to_thread.run_sync(done.result)
        return await asyncio.wrap_future(done, loop=loop)

    def shutdown(self) -> None:
        self.pool.shutdown()

    def _run(self, prepared: PreparedStep, done: Future, token_ids: list[int] | None) -> None:
        ended: tuple[Future, tuple] | None = None  # the step before and its result, handed out once this one starts

        def hand_out() -> None:
            if ended is not None and not ended[0].done():
                ended[0].set_result(ended[1])

        while True:
            try:
                if token_ids is not None:
                    self.executor.set_tokens(prepared, token_ids)
                tokens = self.executor.forward(prepared, started=hand_out)
                result = (tokens, self.executor.forward_s, self.executor.row_errors, self.executor.row_logprobs)
            except BaseException as exc:  # the queued step (its batch fails too) does not run
                hand_out()
                with self._lock:
                    queued, self._queued, self._running = self._queued, None, None
                done.set_exception(exc)
                if queued is not None:
                    queued[2].set_exception(exc)
                return
            hand_out()  # (a forward that did not call it)
            with self._lock:
                queued, self._queued = self._queued, None
                self._running = None if queued is None else queued[2]
            if queued is None:
                done.set_result(result)
                return
            ended = (done, result)
            prepared, rows, done = queued
            token_ids = [tokens[i][0] for i in rows]


def _rows(samplers: list[Sequence]) -> list[Row | None] | None:
    """What each sample's logits processors read (`PreparedStep.rows`), its output copied: the event loop appends
    to it while the forward runs. None for a step of plain rows (the common step: one pass over them)."""
    if not any(s.needs_logits for s in samplers):
        return None
    return [Row(s.params, s.prompt_ids, tuple(s.output_ids), s.stop_ids, s.processors, s.state) if s.processors
            else None for s in samplers]


def _started_future() -> Future:
    done: Future = Future()
    done.set_running_or_notify_cancel()  # a running step cannot be cancelled, only waited for
    return done
