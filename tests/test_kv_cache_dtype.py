"""A bf16 KV cache (`EngineConfig(kv_cache_dtype="bf16")`) under an fp32 model: greedy tokens are `generate`'s with
every key and value rounded as the cache holds them (`RoundedKV`), on the one-call decoder and on transformers'
layers over the `cpu` attention backend; deterministic, batch-invariant, unchanged by speculation, prefix sharing
and offload; half the cache's bytes; refused where the attention backend cannot read it."""

from __future__ import annotations

import pytest
import torch
import transformers as T
from support import engine_tokens, random_requests, reference, scaled_tiny, tiny_llama

from jitney import Engine, EngineConfig, Request, SamplingParams
from jitney.kernels import native
from jitney.kernels.base import RoundedKV

pytestmark = pytest.mark.skipif(not native.available(), reason="a bf16 cache under fp32 queries needs jitney's C++ kernels")

MODELS = {  # (scaled: rounding the keys and values changes tokens, so the test tells bf16 from fp32)
    "llama": lambda: scaled_tiny(T.LlamaConfig, T.LlamaForCausalLM, num_key_value_heads=2),  # the one-call decoder
    "mistral window": lambda: scaled_tiny(T.MistralConfig, T.MistralForCausalLM, num_key_value_heads=1, sliding_window=8),
    # (eager attention in the reference; a cap that changes tokens, and not so low that rounding no longer does)
    "gemma2 softcap": lambda: scaled_tiny(T.Gemma2Config, T.Gemma2ForCausalLM, num_key_value_heads=2, head_dim=16,
                                          attn_logit_softcapping=8.0, sliding_window=8, tie_word_embeddings=False,
                                          query_pre_attn_scalar=16),
    "phi3": lambda: scaled_tiny(T.Phi3Config, T.Phi3ForCausalLM, num_key_value_heads=2),  # packed linears, torch layers
}


async def run(model, work, **config) -> list[list[int]]:
    """Greedy tokens of `work` through a bf16-cache engine (`config` overrides)."""
    return await engine_tokens(model, work, **{"kv_cache_dtype": "bf16", **config})


@pytest.mark.parametrize("fuse", [None, False], ids=["default", "not fused"])
@pytest.mark.parametrize("name", list(MODELS))
async def test_tokens_are_generates_with_the_keys_and_values_rounded(name, fuse):
    model = MODELS[name]()
    work = random_requests(8, model.config.vocab_size, max_prompt=40, max_new=20, seed=3)
    fp32 = [reference(model, p, n) for p, n in work]
    with RoundedKV(model):
        rounded = [reference(model, p, n) for p, n in work]
    assert rounded != fp32, "the workload should tell a bf16 cache from an fp32 one"
    assert await run(model, work, fuse_cpu_layers=fuse) == rounded
    assert [reference(model, p, n) for p, n in work] == fp32  # the model's own attention is back


async def test_bf16_cache_is_batch_invariant_deterministic_and_unchanged_by_speculation():
    model = MODELS["llama"]()
    work = random_requests(6, model.config.vocab_size, max_prompt=40, max_new=16, seed=5)
    together = await run(model, work, speculative_tokens=0)
    assert [(await run(model, [w], speculative_tokens=0))[0] for w in work] == together
    assert await run(model, work, max_batch_tokens=5, speculative_tokens=0) == together  # prompts chunked differently
    assert await run(model, work, speculative_tokens=3) == together


async def test_bf16_cache_tokens_survive_prefix_sharing_and_offload():
    model = MODELS["llama"]()
    shared = random_requests(1, model.config.vocab_size, max_prompt=30, max_new=1, seed=8)[0][0]
    work = [(shared[: 12 + i], n) for i, (_, n) in enumerate(random_requests(8, 256, max_new=24, seed=9))]
    with RoundedKV(model):
        want = [reference(model, p, n) for p, n in work]
    assert await run(model, work) == want  # prefixes shared (the default)
    tight = dict(num_blocks=24, max_batch_tokens=32, safety_margin=0.0, allow_block_sharing=False)
    assert await run(model, work, cpu_offload_space=0.01, **tight) == want
    assert await run(model, work, **tight) == want  # soft resets


def test_bf16_cache_holds_twice_the_tokens_in_the_same_memory(monkeypatch):
    from jitney.cache import sizing

    monkeypatch.setattr(sizing, "available_memory", lambda device: 4 << 20)
    model = tiny_llama()
    fp32, bf16 = (Engine(model, config=EngineConfig(block_size=4, kv_cache_dtype=kv)).cache for kv in (None, "bf16"))
    assert bf16.keys[0].dtype == torch.bfloat16 and fp32.keys[0].dtype == torch.float32
    # a step's activations stay fp32: the same overhead, then twice the blocks (two of each are for padding)
    assert 2 * (fp32.num_blocks + 2) <= bf16.num_blocks + 2 <= 2 * (fp32.num_blocks + 2) + 1


async def test_bf16_cache_is_refused_where_the_attention_cannot_read_it():
    model = tiny_llama()
    with pytest.raises(ValueError, match=r"kv_cache_dtype='bf16': the attention backend 'torch' does not read a bf16 cache "
                                         r"under float32 queries"):
        async with Engine(model, config=EngineConfig(kv_cache_dtype="bf16", attention_backend="torch")):
            pass
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp8")
    # a bf16 model's cache is bf16 anyway: every backend serves it
    half = tiny_llama().to(torch.bfloat16)
    async with Engine(half, config=EngineConfig(kv_cache_dtype="bf16", attention_backend="torch", num_blocks=64)) as engine:
        assert engine.cache.keys[0].dtype == torch.bfloat16
        assert (await engine.generate(Request([5, 6, 7], SamplingParams(max_new_tokens=3)))).token_ids
    # refused when built, nothing bound: the model serves afterwards
    async with Engine(model, config=EngineConfig(kv_cache_dtype="bf16")) as engine:
        assert (await engine.generate(Request([5, 6, 7], SamplingParams(max_new_tokens=3)))).token_ids


async def test_bf16_model_on_the_one_call_decoder_takes_a_bf16_cache():
    """A bf16 model computing in fp32 on the one-call decoder (`compute="fp32"`) does so over an fp32 cache by
    default; with the option, over a bf16 one: `generate` of the model upcast with its keys and values rounded."""
    import copy

    model = MODELS["llama"]().to(torch.bfloat16)
    work = random_requests(4, model.config.vocab_size, max_prompt=30, max_new=12, seed=4)
    upcast = copy.deepcopy(model).float()
    with RoundedKV(upcast):
        want = [reference(upcast, p, n) for p, n in work]
    assert await run(model, work, compute="fp32") == want


def test_quality_scores_a_bf16_cache(tmp_path, capsys):
    import json

    from jitney.cli import main as cli

    out = tmp_path / "quality.json"
    assert cli(["quality", "--weights", "fp32,fp32+kvbf16", "--tokens", "200", "--window", "100", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["weights"] for r in rows] == ["fp32", "fp32+kvbf16"]
    assert abs(rows[1]["perplexity_vs_first"]) < 0.02 and rows[1]["top1_same_as_first"] > 0.9
    assert cli(["quality", "--weights", "fp32+kv8"]) == 2
    assert "unknown 'fp32+kv8'" in capsys.readouterr().err


def test_smollm2_answers_over_a_bf16_cache(smollm2):
    """The embedded model passes the start-up check over a bf16 cache (its reference rounds keys and values too),
    with fp32 and with w8a8 weights, and answers as over an fp32 one."""
    from jitney import LLM

    model, tokenizer = smollm2
    prompt = "The capital of France is"
    plain, rounded = (LLM(model, EngineConfig(num_blocks=64, kv_cache_dtype=kv), tokenizer=tokenizer)
                      .generate(prompt, SamplingParams(max_new_tokens=8), progress=False)[0] for kv in (None, "bf16"))
    assert "Paris" in rounded.text and rounded.token_ids[:4] == plain.token_ids[:4]
    # with int8 weights and activations too (the check's tolerance for both: the two roundings add up)
    w8a8 = LLM(model, EngineConfig(num_blocks=64, kv_cache_dtype="bf16", weights="w8a8"), tokenizer=tokenizer)
    assert "Paris" in w8a8.generate(prompt, SamplingParams(max_new_tokens=8), progress=False)[0].text
