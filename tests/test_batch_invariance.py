"""A request's logits are bit-identical alone or in a crowd, whatever arrives when and however its prompt is
chunked (what `SamplingParams.seed` promises): by default on the paths that are invariant anyway, with
`EngineConfig(batch_invariant=True)` on every backend and dtype. Which default holds what: docs/reliability.md."""

from __future__ import annotations

import random

import anyio
import pytest
import torch
from support import tiny_llama

from jitney import Engine, EngineConfig, Request, SamplingParams

# A prompt of 17 tokens: alone, at 16 tokens a step, its last token is a one-token chunk of its own.
GREEDY = Request(list(range(5, 22)), SamplingParams(max_new_tokens=12, ignore_eos=True), request_id="greedy")
SEEDED = Request(list(range(40, 73)), SamplingParams(max_new_tokens=12, temperature=1.0, seed=7, ignore_eos=True),
                 request_id="seeded")


def crowd(n: int = 8) -> list[Request]:
    """Prompts of 1 to 30 tokens, greedy and seeded, ending at different steps."""
    rng = random.Random(1)
    return [Request([rng.randrange(3, 256) for _ in range(rng.randint(1, 30))],
                    SamplingParams(max_new_tokens=rng.randint(4, 16), temperature=rng.choice([0.0, 1.0]), seed=i,
                                   ignore_eos=True), request_id=f"crowd{i}") for i in range(n)]


def record_logits(engine: Engine) -> dict[str, list[torch.Tensor]]:
    """Each request's logits, step by step, as the executor samples from them (a test hook on its instance)."""
    ex, seen = engine.executor, {}
    prepare, logits, decoded = ex.prepare, ex.logits, ex._decoded

    def prepare_named(entries, *args, **kwargs):
        prepared = prepare(entries, *args, **kwargs)
        prepared.request_ids = [s.request_id for s, _ in entries]
        return prepared

    def logits_recorded(prepared, *args, **kwargs):
        out, argmax = logits(prepared, *args, **kwargs)
        for row, entry in enumerate(prepared.sampled_entries):
            seen.setdefault(prepared.request_ids[entry], []).append(out[row].clone())
        return out, argmax

    def decoded_recorded(prepared, started, greedy=False):
        if greedy:  # (greedy steps of the one-call decoder compute no logits: the same step's, recorded first)
            logits_recorded(prepared)
        return decoded(prepared, started, greedy)

    ex.prepare, ex.logits, ex._decoded = prepare_named, logits_recorded, decoded_recorded
    return seen


async def serve(model, config: EngineConfig, others: list[Request], targets_after: int):
    """The two targets' tokens and logits; the crowd `others` starts first, the targets join once one of it has
    streamed `targets_after` tokens (0: the targets first, the crowd right behind them)."""
    tokens = {}
    async with Engine(model, config=config) as engine:
        logits = record_logits(engine)
        joined = anyio.Event()

        async def one(req: Request) -> None:
            tokens[req.request_id] = (await engine.generate(req)).token_ids

        async def first_of_crowd(req: Request) -> None:
            got = []
            async with engine.stream(req) as stream:
                async for tok in stream:
                    got.append(tok)
                    if len(got) == targets_after:
                        joined.set()
            joined.set()

        async with anyio.create_task_group() as tg:
            if others and targets_after:
                tg.start_soon(first_of_crowd, others[0])
                for req in others[1:]:
                    tg.start_soon(one, req)
                await joined.wait()
            for req in (GREEDY, SEEDED):
                tg.start_soon(one, req)
            if not targets_after:
                await anyio.sleep(0)
                for req in others:
                    tg.start_soon(one, req)
    return {r: tokens[r] for r in ("greedy", "seeded")}, {r: logits[r] for r in ("greedy", "seeded")}


def assert_same(alone, together) -> None:
    for request in ("greedy", "seeded"):
        assert together[0][request] == alone[0][request], request
        a, b = alone[1][request], together[1][request]
        assert len(a) == len(b) == 12
        for position, (x, y) in enumerate(zip(a, b)):
            assert torch.equal(x, y), f"{request}: logits at output {position} differ by {(x - y).abs().max().item():.3g}"


def config(backend: str | None, invariant: bool, **kw) -> EngineConfig:
    return EngineConfig(attention_backend=backend, batch_invariant=invariant, max_batch_tokens=16, block_size=4,
                        num_blocks=400, speculative_tokens=0, **kw)


@pytest.mark.parametrize("backend, dtype, invariant", [
    ("cpu", torch.float32, False),  # the default for fp32 on CPU
    ("triton", torch.float32, False),  # (batch_invariant changes nothing there)
    ("cpu", torch.float32, True),
    ("torch", torch.float32, True),
    ("torch", torch.bfloat16, True),  # (torch's bf16 path: a model the one-call decoder does not take)
    (None, torch.bfloat16, False),  # the default for bf16 on CPU: the one-call decoder in fp32 over the bf16 weights
    (None, torch.float16, False),  # (and for fp16)
])
async def test_logits_alone_and_in_a_crowd_are_bit_identical(backend, dtype, invariant):
    model = tiny_llama().to(dtype)
    cfg = config(backend, invariant)
    alone = await serve(model, cfg, [], 0)
    assert_same(alone, await serve(model, cfg, crowd(), 0))  # the targets first, chunked among the crowd's prompts
    assert_same(alone, await serve(model, cfg, crowd(), 3))  # the targets join a crowd that decodes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
async def test_bf16_compute_logits_alone_and_in_a_crowd_are_bit_identical(dtype):
    model = tiny_llama().to(dtype)
    cfg = config(None, False, compute="bf16")  # (each row through the matrix units on its own)
    alone = await serve(model, cfg, [], 0)
    assert_same(alone, await serve(model, cfg, crowd(), 0))
    assert_same(alone, await serve(model, cfg, crowd(), 3))


async def test_default_cpu_path_with_speculation_keeps_tokens_alone_and_in_a_crowd():
    model = tiny_llama()
    cfg = EngineConfig(max_batch_tokens=16, block_size=4, num_blocks=400)  # speculative decoding on (greedy rows)
    alone, together = await serve(model, cfg, [], 0), await serve(model, cfg, crowd(), 3)
    assert together[0] == alone[0]


@pytest.mark.parametrize("fields, why", [
    ({"pack_cpu_weights": False}, "pack_cpu_weights=False"),
    ({"attention_backend": "custom"}, "does not declare batch_invariant"),
])
def test_batch_invariant_is_refused_where_it_cannot_hold(fields, why):
    class Custom:
        def prepare(self, step):
            raise AssertionError("never reached")

    class Plugin:
        from jitney.core.hooks import hookimpl

        @hookimpl
        def jitney_register_attention_backends(self, register):
            register("custom", lambda device: Custom())

    with pytest.raises(ValueError, match=f"EngineConfig.batch_invariant: .*{why}"):
        Engine(tiny_llama(), config=EngineConfig(batch_invariant=True, num_blocks=50, **fields), plugins=[Plugin()])
