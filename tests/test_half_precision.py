"""bf16 and fp16 models: several chunked requests at once give `generate`'s greedy tokens in the same dtype, and
where a request's tokens part from them it is at a near-tie of the two candidates' logits, never a real lead."""

from __future__ import annotations

import copy
import json
import random

import anyio
import pytest
import torch
from support import reference, scaled_tiny, tiny_llama, tiny_mistral
from transformers import LlamaConfig, LlamaForCausalLM

from jitney import Engine, EngineConfig, Request, SamplingParams

MODELS = {
    "llama": tiny_llama,
    "mistral": tiny_mistral,  # sliding window of 8: most contexts here outgrow it
    # weights x5: logits around 10 instead of 0.4, where one bf16 step is 0.0625
    "scaled": lambda: scaled_tiny(LlamaConfig, LlamaForCausalLM, num_key_value_heads=2),
}
# Prompt lengths: 41 and 60 are longer than a step's 16 tokens, so they are prefilled in chunks beside the others'
# decodes; 16 fills a step exactly.
PROMPT_LENS = [1, 4, 9, 15, 16, 23, 41, 60]


def workload(vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(11)
    return [([rng.randrange(3, vocab) for _ in range(n)], rng.randint(12, 24)) for n in PROMPT_LENS]


async def engine_tokens(model, work, **config) -> list[list[int]]:
    done: dict[int, list[int]] = {}

    async def one(i: int) -> None:
        prompt, n = work[i]
        done[i] = (await engine.generate(Request(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True)))).token_ids

    async with Engine(model, config=EngineConfig(num_blocks=200, block_size=4, max_batch_tokens=16, **config)) as engine:
        async with anyio.create_task_group() as tg:
            for i in range(len(work)):
                tg.start_soon(one, i)
        assert engine.num_free_blocks == 200
    return [done[i] for i in range(len(work))]


def logits_after(model, prefix: list[int]) -> torch.Tensor:
    """The model's own eager logits (its dtype, read as fp32) for the token after `prefix`."""
    with torch.inference_mode():
        return model(torch.tensor([prefix])).logits[0, -1].float()


def near_tie(model, prefix: list[int], ours: int, theirs: int) -> tuple[bool, float]:
    """Whether jitney's token `ours` and generate's `theirs` after `prefix` (the prompt and generate's tokens
    before the first difference) are a near-tie, and the gap in steps of the dtype.

    A step is eps x the larger logit's magnitude: the spacing of the dtype's values there is at most that (bf16
    has 8 significant bits, eps 2**-7; fp16 11, eps 2**-10). Each path (jitney's paged, batched kernels and
    generate's) rounds every op's output to the dtype, so each of the two logits may land a step to either side
    and their difference may move by two steps: up to two steps the order of the two tokens is rounding.

    Beyond two steps the referee is exact arithmetic on the same weights (the model upcast to fp32): a model
    whose own half-precision logits are many steps off (the scaled model in bf16: up to 2.6 at magnitude 9,
    40 steps) may order the candidates either way, and the difference is acceptable only if fp32 does not prefer
    generate's token to jitney's."""
    logits = logits_after(model, prefix)
    a, b = logits[ours].item(), logits[theirs].item()
    steps = abs(a - b) / (torch.finfo(model.dtype).eps * max(abs(a), abs(b)))
    if steps <= 2:
        return True, steps
    exact = logits_after(copy.deepcopy(model).float(), prefix)
    return bool(exact[ours] >= exact[theirs]), steps


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(MODELS))
async def test_half_precision_greedy_matches_generate_but_at_near_ties(name, dtype):
    model = MODELS[name]().to(dtype)
    work = workload(model.config.vocab_size)
    refs = [reference(model, prompt, n) for prompt, n in work]
    outs = await engine_tokens(model, work)
    differing = []
    for (prompt, _), ref, out in zip(work, refs, outs):
        assert len(out) == len(ref)
        k = next((i for i, (x, y) in enumerate(zip(out, ref)) if x != y), None)
        if k is not None:  # after it the two continue different texts: only the first difference is comparable
            tie, steps = near_tie(model, prompt + ref[:k], out[k], ref[k])
            differing.append((len(prompt), k, round(steps, 2)))
            assert tie, f"prompt of {len(prompt)}, token {k}: jitney {out[k]}, generate {ref[k]}, {steps:.2f} steps apart"
    print(name, dtype, f"identical {len(work) - len(differing)}/{len(work)}; (prompt, position, steps):", differing)
    # measured on this project's CPU machine: 6, 6 and 4 of 8 in bf16 (llama, mistral, scaled; on the one-call
    # decoder, in fp32 over the bf16 weights: 7, 7 and 5 on torch's bf16 path; its rows in bf16, the default where
    # the CPU has AVX512-BF16 or AMX: 6, 6 and 6 on a Zen 4), 8 of 8 in fp16 (both paths)
    assert len(differing) <= 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("make", [tiny_llama, tiny_mistral], ids=["llama", "mistral"])
async def test_a_half_precision_model_runs_the_one_call_decoder_in_fp32_over_its_own_weights(make, dtype):
    model = make().to(dtype)
    before = {n: p.clone() for n, p in model.state_dict().items()}
    work = workload(model.config.vocab_size)
    fp32 = dict(compute="fp32")  # (a bf16 model's default on a CPU with AMX or AVX512-BF16 is bf16 rows)
    async with Engine(model, config=EngineConfig(num_blocks=200, block_size=4, max_batch_tokens=16, **fp32)) as engine:
        assert engine.executor.decoder is not None and engine.cache.keys[0].dtype == torch.float32
    # the same bf16 weights computed in fp32: `generate` of the model upcast
    upcast = copy.deepcopy(model).float()
    assert await engine_tokens(model, work, **fp32) == [reference(upcast, prompt, n) for prompt, n in work]
    assert all(torch.equal(p, before[n]) and p.dtype == dtype for n, p in model.state_dict().items())


@pytest.mark.parametrize("config", [dict(attention_backend="torch"), dict(fuse_cpu_layers=False), dict(batch_invariant=True)],
                         ids=["torch attention", "not fused", "batch-invariant"])
async def test_a_bf16_model_stays_in_bf16_where_the_decoder_does_not_serve(config):
    model = tiny_llama().to(torch.bfloat16)
    async with Engine(model, config=EngineConfig(num_blocks=64, block_size=4, **config)) as engine:
        assert engine.executor.decoder is None and engine.cache.keys[0].dtype == torch.bfloat16
        assert "forward" not in vars(model.model.layers[0])
        assert (await engine.generate(Request([5, 6, 7], SamplingParams(max_new_tokens=4)))).token_ids


def test_bench_runs_the_model_in_bf16_and_writes_each_modes_tokens(tmp_path):
    from jitney.cli import main as cli

    tiny_llama().save_pretrained(tmp_path / "tiny")
    out, tokens = tmp_path / "bench.json", tmp_path / "tokens.json"
    assert cli(["bench", "--model", str(tmp_path / "tiny"), "--workload", "long-prompt", "--max-batch-tokens", "48",
                "--modes", "jitney,hf-static", "--dtype", "bfloat16", "--json", str(out), "--tokens", str(tokens)]) == 0
    report, written = json.loads(out.read_text()), json.loads(tokens.read_text())
    model = tiny_llama()
    # two bytes a weight: the converted model is the one measured (the untied embedding is not read whole)
    assert report["dtype"] == "bfloat16"
    assert report["weight_bytes"] == 2 * (sum(p.numel() for p in model.parameters()) - model.model.embed_tokens.weight.numel())
    assert written["dtype"] == "bfloat16" and set(written["outputs"]) == {"jitney", "hf-static"}
    for row in report["rows"]:
        assert sum(map(len, written["outputs"][row["mode"]])) == report["output_tokens"]
    print("bench bf16, same tokens as jitney:", {r["mode"]: r["same_tokens_as_first"] for r in report["rows"]})
