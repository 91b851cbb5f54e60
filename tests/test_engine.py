"""The engine end to end on a tiny random Llama: same tokens as `generate`, streaming, aborts, bad input."""

from __future__ import annotations

import anyio
import pytest
from support import random_requests, reference, tiny_gemma2, tiny_gemma3, tiny_mistral

from jitney import Engine, EngineConfig, Request, RequestError, SamplingParams
from jitney.core import events as ev
from jitney.core.hooks import hookimpl
from jitney.core.request import Priority, RequestStatus


async def run_all(engine: Engine, requests: list[Request]):
    results = {}

    async def one(i: int, req: Request) -> None:
        results[i] = await engine.generate(req)

    async with anyio.create_task_group() as tg:
        for i, req in enumerate(requests):
            tg.start_soon(one, i, req)
    return [results[i] for i in range(len(requests))]


def greedy(prompt, n):
    return Request(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True))


@pytest.mark.parametrize("scheduler", ["fifo", "prefill_first", "priority"])
async def test_concurrent_chunked_requests_match_generate(llama, scheduler):
    work = random_requests(20, llama.config.vocab_size, max_prompt=70)
    refs = [reference(llama, p, n) for p, n in work]
    # 16 query tokens per step: most prompts are split across several steps.
    config = EngineConfig(max_batch_tokens=16, block_size=4, num_blocks=400, scheduler=scheduler)
    async with Engine(llama, config=config) as engine:
        done = await run_all(engine, [Request(p, SamplingParams(max_new_tokens=n, ignore_eos=True), priority=i % 2)
                                      for i, (p, n) in enumerate(work)])
        assert engine.num_free_blocks == 400
    for (prompt, n), ref, out in zip(work, refs, done):
        assert out.token_ids == ref
        assert out.finish_reason == "length"
        assert out.prompt_token_ids == prompt


def test_chunk_context_cost_is_the_models_unless_given(llama):
    c = llama.config
    per_layer = sum(p.numel() for n, p in llama.model.layers[0].named_parameters() if p.dim() == 2)
    # attention's multiply-adds per position (2 x heads x head_dim a layer) over a token's through the linears,
    # at half their pace
    expected = 2 * c.num_attention_heads * (c.hidden_size // c.num_attention_heads) / per_layer / 0.5
    assert Engine(llama, config=EngineConfig(num_blocks=64)).config.chunk_context_cost == pytest.approx(expected)
    assert Engine(llama, config=EngineConfig(num_blocks=64, chunk_context_cost=0.0)).config.chunk_context_cost == 0.0
    gemma = tiny_gemma3()  # one full-attention layer of three: the sliding ones' reach is bounded, left out
    g = gemma.config
    linear = sum(p.numel() for n, p in gemma.model.layers.named_parameters() if p.dim() == 2)
    cost = Engine(gemma, config=EngineConfig(num_blocks=64)).config.chunk_context_cost
    assert cost == pytest.approx(2 * g.num_attention_heads * g.head_dim * 1 / linear / 0.5)


async def test_chunks_sized_by_their_attention_keep_tokens(llama):
    work = random_requests(8, llama.config.vocab_size, max_prompt=70, seed=7)
    refs = [reference(llama, p, n) for p, n in work]
    k, computed, chunks = 0.02, {}, []  # a token at 50 positions counts 2

    class Chunks:
        @hookimpl
        def jitney_on_events(self, events, engine):
            for e in (e for e in events if isinstance(e, ev.StepCompleted)):
                for rid, n in e.batch:
                    if n > 1:
                        chunks.append((computed.get(rid, 0), n))
                    computed[rid] = computed.get(rid, 0) + n

    config = EngineConfig(max_batch_tokens=32, block_size=4, num_blocks=400, chunk_context_cost=k, allow_block_sharing=False)
    async with Engine(llama, config=config, plugins=[Chunks()]) as engine:
        done = await run_all(engine, [greedy(p, n) for p, n in work])
    assert [d.token_ids for d in done] == refs
    assert all(n + k * (n * c + n * (n + 1) / 2) <= 32 for c, n in chunks)
    assert max(n for c, n in chunks if c == 0) == 25 and max(n for c, n in chunks if c >= 40) < 20


async def test_a_prompt_chunk_of_one_token_counts_as_prompt_tokens(llama):
    seen: list[ev.Event] = []

    class Observer:
        @hookimpl
        def jitney_on_events(self, events, engine):
            seen.extend(events)

    lengths = (70, 45, 12, 30)  # with 24 tokens a step, some steps have one token left for a prompt
    prompts = [[3 + (7 * i + j) % 250 for j in range(n)] for i, n in enumerate(lengths)]
    config = EngineConfig(max_batch_tokens=24, block_size=4, num_blocks=200)
    async with Engine(llama, config=config, plugins=[Observer()]) as engine:
        await run_all(engine, [greedy(p, 8) for p in prompts])
    chunks = [e for e in seen if isinstance(e, ev.PrefillChunk)]
    steps = [e for e in seen if isinstance(e, ev.StepCompleted)]
    assert any(c.tokens == 1 for c in chunks)
    assert sum(s.prefill_tokens for s in steps) == sum(c.tokens for c in chunks) == sum(lengths)


async def test_sliding_window_model_matches_generate():
    model = tiny_mistral(window=8)
    work = random_requests(6, model.config.vocab_size, max_prompt=30, max_new=20, seed=3)
    refs = [reference(model, p, n) for p, n in work]
    async with Engine(model, config=EngineConfig(max_batch_tokens=12, block_size=4, num_blocks=200)) as engine:
        assert not engine.cache.prefix_caching  # sliding layers: prefix caching turns itself off
        done = await run_all(engine, [greedy(p, n) for p, n in work])
    assert [d.token_ids for d in done] == refs


async def test_soft_reset_under_a_small_cache_keeps_tokens(llama):
    work = random_requests(8, llama.config.vocab_size, max_prompt=20, max_new=30, seed=5)
    refs = [reference(llama, p, n) for p, n in work]
    seen, misreported = [], []

    class Recorder:
        @hookimpl
        def jitney_on_events(self, events, engine):
            seen.extend(e for e in events if isinstance(e, ev.RequestSoftReset))
            # a request decoding again after its reset says so
            misreported.extend(s.status for s in engine.active if s.output_ids and s.remaining == 1 and s.status is not RequestStatus.DECODING)

    # 16 blocks of 4 tokens: far less than the 8 requests need together.
    config = EngineConfig(max_batch_tokens=32, block_size=4, num_blocks=16, safety_margin=0.0)
    async with Engine(llama, config=config, plugins=[Recorder()]) as engine:
        done = await run_all(engine, [greedy(p, n) for p, n in work])
        assert engine.num_free_blocks == 16
    assert [d.token_ids for d in done] == refs
    assert seen, "the cache was too small for all requests: some must have been reset"
    assert not misreported


async def test_priority_preempts_background_work_and_background_still_finishes(llama):
    # Six background requests whose prompts alone take 48 of the 56 blocks, and that grow to 108.
    background = [([3 + i] * 30 + [50], 40) for i in range(6)]
    interactive = [([100 + i] * 20, 10) for i in range(3)]
    refs = [reference(llama, p, n) for p, n in background + interactive]
    resets, finished = [], []

    class Recorder:
        @hookimpl
        def jitney_on_events(self, events, engine):
            resets.extend(e.request_id for e in events if isinstance(e, ev.RequestSoftReset))
            finished.extend(e.request_id for e in events if isinstance(e, ev.RequestFinished))

    config = EngineConfig(scheduler="priority", block_size=4, num_blocks=56, max_batch_tokens=64, safety_margin=0.0)
    bg = [Request(p, SamplingParams(max_new_tokens=n, ignore_eos=True), priority=Priority.BACKGROUND) for p, n in background]
    fg = [Request(p, SamplingParams(max_new_tokens=n, ignore_eos=True)) for p, n in interactive]
    async with Engine(llama, config=config, plugins=[Recorder()]) as engine:
        streams = [engine.stream(r) for r in bg]
        for s in streams:  # let the background work fill the cache first
            await s.__anext__()
        done = await run_all(engine, fg)
        assert engine.waiting or engine.active  # background work was still pending when interactive finished
        rest = []
        for s in streams:  # (an async comprehension inside a plain one needs Python 3.11; the package takes 3.10)
            rest.append([t.token_id async for t in s])
    bg_ids = {s.request_id for s in streams}
    assert resets and set(resets) <= bg_ids
    assert finished.index(done[-1].request_id) < max(finished.index(i) for i in bg_ids)
    outputs = [[s.collector.samples[0].output_ids[0]] + r for s, r in zip(streams, rest)]
    assert outputs + [d.token_ids for d in done] == refs


async def test_first_token_streams_before_the_request_finishes(llama):
    ref = reference(llama, [5, 6, 7], 20)
    async with Engine(llama, config=EngineConfig(num_blocks=64)) as engine:
        stream = engine.stream(greedy([5, 6, 7], 20))
        first = await stream.__anext__()
        assert not stream.done
        rest = [t.token_id async for t in stream]
    assert [first.token_id] + rest == ref


async def test_breaking_out_of_a_stream_frees_its_blocks(llama):
    ref = reference(llama, [1, 2, 3], 4)
    async with Engine(llama, config=EngineConfig(num_blocks=64, block_size=4)) as engine:
        start = engine.num_free_blocks
        async for _ in engine.stream(greedy(list(range(10, 40)), 100)):
            break
        assert engine.num_free_blocks == start  # freed at once, not when the request would have ended
        # the engine keeps serving
        done = await engine.generate(greedy([1, 2, 3], 4))
    assert done.token_ids == ref


async def test_cancelling_a_consumer_aborts_its_request(llama):
    async with Engine(llama, config=EngineConfig(num_blocks=64, block_size=4)) as engine:
        start = engine.num_free_blocks
        got = []

        async def consume() -> None:
            async with engine.stream(greedy(list(range(10, 40)), 200)) as stream:
                async for tok in stream:
                    got.append(tok)

        with anyio.move_on_after(0.3):
            await consume()
        assert got
        assert not engine.requests
        assert engine.num_free_blocks == start


async def test_abort_by_id(llama):
    async with Engine(llama, config=EngineConfig(num_blocks=64)) as engine:
        req = greedy([4, 5, 6], 200)
        stream = engine.stream(req)
        await stream.__anext__()
        assert engine.abort(stream.request_id)
        _ = [t async for t in stream]
        done = stream.completion()
        assert done.finish_reason == "cancelled"
        assert len(done.token_ids) < 200
        assert not engine.abort(stream.request_id)  # already gone


async def test_stop_token_ends_the_request(llama):
    ref = reference(llama, [9, 8, 7], 10)
    stop = ref[4]
    async with Engine(llama, config=EngineConfig(num_blocks=64)) as engine:
        done = await engine.generate(Request([9, 8, 7], SamplingParams(max_new_tokens=10, stop_token_ids=(stop,))))
    assert done.finish_reason == "stop"
    assert done.token_ids == ref[: ref.index(stop) + 1]


async def test_seeded_sampling_is_reproducible_whatever_the_batch(llama):
    params = SamplingParams(max_new_tokens=12, temperature=0.8, top_k=50, top_p=0.9, seed=123, ignore_eos=True)
    async with Engine(llama, config=EngineConfig(num_blocks=128)) as engine:
        alone = await engine.generate(Request([3, 4, 5], params))
        crowd = await run_all(engine, [Request([3, 4, 5], params)] + [greedy([7] * k, 12) for k in range(1, 6)])
        other = await engine.generate(Request([3, 4, 5], SamplingParams(max_new_tokens=12, temperature=0.8, seed=7, ignore_eos=True)))
    assert alone.token_ids == crowd[0].token_ids
    assert other.token_ids != alone.token_ids


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: Request([], SamplingParams()), "empty"),
        (lambda: Request([1] * 500, SamplingParams(max_new_tokens=100)), "context"),
        (lambda: Request([1, 2], SamplingParams(max_new_tokens=0)), "max_new_tokens"),
        (lambda: Request([1, 2], SamplingParams(temperature=-1)), "temperature"),
        (lambda: Request([1, 2], SamplingParams(top_p=0)), "top_p"),
        (lambda: Request([1, 2], SamplingParams(top_p=1.5)), "top_p"),
        (lambda: Request([1, 99999]), "vocabulary"),
        (lambda: Request("text needs a tokenizer"), "tokenizer"),
        (lambda: Request([1] * 200, SamplingParams(max_new_tokens=100)), "cache"),
    ],
)
async def test_bad_requests_raise_before_anything_is_allocated(llama, make, message):
    ref = reference(llama, [1, 2, 3], 30)
    async with Engine(llama, config=EngineConfig(num_blocks=16, block_size=16)) as engine:
        busy = engine.stream(greedy([1, 2, 3], 30))
        start = engine.num_free_blocks
        with pytest.raises(ValueError, match=message):
            engine.submit(make())
        assert engine.num_free_blocks == start
        assert [t.token_id async for t in busy] == ref


def test_unknown_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no model"):
        Engine.from_pretrained(str(tmp_path / "missing"))


async def test_a_failing_forward_fails_its_requests_not_the_engine(llama):
    ref = reference(llama, [1, 2, 3], 5)

    def broken(*args):
        raise RuntimeError("kernel exploded")

    async with Engine(llama, config=EngineConfig(num_blocks=64)) as engine:
        engine.executor._forward = broken  # (the model's forward or the one-call decoder, whichever runs)
        stream = engine.stream(greedy([1, 2, 3], 5))
        with pytest.raises(RequestError, match="kernel exploded"):
            _ = [t async for t in stream]
        assert stream.completion().finish_reason == "error"
        assert engine.num_free_blocks == 64
        del engine.executor._forward
        done = await engine.generate(greedy([1, 2, 3], 5))
    assert done.token_ids == ref


async def test_an_error_in_the_callers_block_propagates_as_itself(llama):
    with pytest.raises(KeyError):
        async with Engine(llama, config=EngineConfig(num_blocks=16)) as engine:
            engine.stream(greedy([1, 2, 3], 50))
            raise KeyError("the caller's own error")
    assert not engine.requests and engine.num_free_blocks == 16


@pytest.mark.parametrize("make_model", [lambda: None, lambda: tiny_mistral(window=8)], ids=["llama", "mistral-window"])
async def test_triton_backend_matches_generate(llama, make_model):
    model = make_model() or llama
    work = random_requests(5, model.config.vocab_size, max_prompt=30, max_new=12, seed=8)
    refs = [reference(model, p, n) for p, n in work]
    config = EngineConfig(attention_backend="triton", block_size=16, max_batch_tokens=24, num_blocks=64)
    async with Engine(model, config=config) as engine:
        done = await run_all(engine, [greedy(p, n) for p, n in work])
    assert [d.token_ids for d in done] == refs


@pytest.mark.parametrize("make_model", [lambda: tiny_mistral(window=8), lambda: tiny_gemma2(window=8)],
                         ids=["all-sliding", "alternating"])
async def test_sliding_groups_give_back_blocks_and_keep_tokens(make_model):
    model = make_model()
    work = random_requests(6, model.config.vocab_size, max_prompt=40, max_new=30, seed=6)
    refs = [reference(model, p, n) for p, n in work]
    config = EngineConfig(block_size=4, num_blocks=200, max_batch_tokens=16)
    async with Engine(model, config=config) as engine:
        groups = {g.name: g for g in engine.cache.groups}
        assert groups["sliding"].window == 8 and not engine.cache.prefix_caching
        stream = engine.stream(greedy(list(range(10, 50)), 30))
        async with stream:
            async for tok in stream:
                seq = stream.collector.samples[0]
                if seq.num_computed > 24 and engine.cache.holds(seq.request_id):
                    for g, group in enumerate(engine.cache.groups):
                        table = engine.cache.block_table(seq.request_id, g)
                        live = [b for b in table if b != engine.cache.pools[g].padding_block]
                        if group.window is None:
                            assert len(live) == len(table)  # full attention keeps everything
                        else:
                            assert len(live) <= 8 // 4 + 2  # the window plus the block being filled
        done = await run_all(engine, [greedy(p, n) for p, n in work])
        assert engine.num_free_blocks == 200
    assert [d.token_ids for d in done] == refs


async def test_packed_cpu_weights_are_used_while_running_and_removed_after(llama):
    from jitney.kernels import cpu_linear

    if not cpu_linear.available():
        pytest.fail("oneDNN linear is not available in this torch build")
    ref = reference(llama, [4, 5, 6], 8)
    proj = llama.model.layers[0].self_attn.q_proj
    async with Engine(llama, config=EngineConfig(num_blocks=32, pack_cpu_weights=True, fuse_cpu_layers=False)) as engine:
        assert "forward" in vars(proj)  # the packed forward is in place
        done = await engine.generate(greedy([4, 5, 6], 8))
    assert "forward" not in vars(proj)
    assert done.token_ids == ref


@pytest.mark.parametrize("ahead", [False, True])
def test_a_decode_steps_rows_are_those_of_the_general_path(ahead):
    from jitney.core.executor import StepExecutor
    from jitney.core.sequence import Sequence

    def decoding(prompt: list[int], outputs: list[int]) -> Sequence:
        s = Sequence(greedy(prompt, 50), prompt, frozenset(), 0)
        s.output_ids = list(outputs)
        s.num_computed = len(prompt) + len(outputs) - 1
        return s

    entries = [(decoding([5, 6, 7], [8]), 1), (decoding([5, 6], [9, 11, 4]), 1), (decoding(list(range(40)), [3]), 1)]
    fast = StepExecutor._decode_rows(entries, ahead)
    assert fast is not None and fast == StepExecutor._mixed_rows(entries, ahead)
    assert fast[1] == ([0, 0, 0] if ahead else [8, 4, 3])  # each row's token: the latest one
    chunk = decoding(list(range(20)), [])
    chunk.num_computed = 10  # a one-token chunk of a prompt: not a decode
    last = decoding(list(range(20)), [])  # the prompt's last token alone: not a decode either (batch invariance)
    for other in (chunk, last):
        assert StepExecutor._decode_rows(entries + [(other, 1)], ahead=False) is None
        assert StepExecutor._mixed_rows(entries + [(other, 1)], ahead=False)[-1] == len(entries)  # decodes counted


async def test_entering_the_engine_leaves_the_event_loop_free(llama, monkeypatch):
    """Start-up's work (packing, the draft, the check) runs on the forward thread while the app's tasks go on."""
    from jitney.core import selfcheck

    real = selfcheck.reference_logits

    def slow(*args, **kw):  # (a tiny model starts in milliseconds: as a real one takes seconds)
        import time

        time.sleep(0.5)
        return real(*args, **kw)

    monkeypatch.setattr(selfcheck, "reference_logits", slow)
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await anyio.sleep(0.02)
            ticks += 1

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        async with Engine(llama, config=EngineConfig(num_blocks=32)) as engine:
            assert engine.healthy
        tg.cancel_scope.cancel()
    assert ticks >= 10  # ~25 in the half second the check's reference took


async def test_each_samples_final_token_says_how_it_ended(llama):
    ref = reference(llama, [5, 6, 7, 8], 6)
    async with Engine(llama, config=EngineConfig(num_blocks=32)) as engine:
        tokens = [t async for t in engine.stream(greedy([5, 6, 7, 8], 6))]
        assert [t.token_id for t in tokens] == ref
        assert [t.finish_reason for t in tokens] == [None] * 5 + ["length"]
        stopped = [t async for t in engine.stream(Request([5, 6, 7, 8], SamplingParams(max_new_tokens=6,
                                                                                      stop_token_ids=[ref[2]])))]
        assert [t.finish_reason for t in stopped] == [None] * ref.index(ref[2]) + ["stop"]  # (its first occurrence)
        both = [t async for t in engine.stream(Request([5, 6, 7], SamplingParams(max_new_tokens=4, n=2,
                                                                                temperature=1.0, seed=3)))]
        for i in (0, 1):
            assert [t.finish_reason for t in both if t.index == i] == [None] * 3 + ["length"]
