"""An int8 KV cache (`EngineConfig(kv_cache_dtype="int8")`): each row (a position's key or value for one KV head) is
int8 codes and an fp32 scale. The C++ writer rounds a row bit for bit as torch's reference (`quantize_kv`) does;
the kernels attend over exactly the rows' values (code times scale); an engine's tokens are deterministic,
batch-invariant, unchanged by chunking, speculation, prefix sharing and offload, and close to `generate`'s over the
same rounding; the cache holds ~3.8x fp32's tokens; refused where the attention backend cannot read it."""

from __future__ import annotations

import pytest
import torch
import transformers as T
from support import engine_tokens, random_requests, reference, scaled_tiny, tiny_llama

from jitney import Engine, EngineConfig, Request, SamplingParams
from jitney.kernels import native
from jitney.kernels.base import RoundedKV, dequantize_kv, quantize_kv

pytestmark = pytest.mark.skipif(not native.available(), reason="an int8 cache needs jitney's C++ kernels")


def rows(n: int, dim: int, seed: int = 0) -> torch.Tensor:
    """Rows of many magnitudes, some with an outlier, a few exact halves of a code, zeros, rows too small to scale
    (127 over their largest magnitude overflows) and non-finite ones."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g) * 10 ** (torch.rand(n, 1, generator=g) * 10 - 6)
    x[: n // 8, 0] *= 50  # an outlier dimension
    x[n // 8 : n // 4] = torch.randint(-254, 255, (n // 4 - n // 8, dim), generator=g).float() / 2  # ties at x.5 codes
    x[-1], x[-2], x[-3, 1], x[-4, 2] = 0.0, -0.0, float("nan"), float("-inf")
    x[-5] *= 1e-38 / x[-5].abs().max()  # (subnormal elements too)
    x[-6] = torch.linspace(-1, 1, dim) * 2.0**-120  # the smallest row that is scaled
    return x


@pytest.mark.parametrize("dim", [64, 24])
def test_the_kernels_round_a_row_as_torchs_reference_does(dim):
    x = rows(512, dim)
    ours, ref = native.load().quantize_kv(x), quantize_kv(x)
    assert ours.shape == (512, dim + 4) and ours.dtype == torch.int8
    assert torch.equal(ours, ref)
    values = dequantize_kv(ref)
    finite = torch.isfinite(x).all(-1)
    assert values[~finite].isnan().all()  # a NaN or an infinity poisons its row, never its neighbours
    normal = finite & (x.abs().amax(-1) >= 2.0**-100)  # (smaller rows' scales are subnormal: fewer bits)
    top = x[normal].abs().amax(-1, keepdim=True)
    assert ((values[normal] - x[normal]).abs() <= top / 254 * (1 + 1e-5)).all()  # half a code at most
    assert (values[-2:] == 0).all() and (values[-5] == 0).all() and (values[-6] != 0).any()


def _paged(dim: int, seed: int = 0):
    """A paged cache of random K/V as fp32 and as int8 rows, block tables and lengths (some past a block's end)."""
    g = torch.Generator().manual_seed(seed)
    kvh, blocks, bs, n = 2, 24, 4, 5
    k, v = (torch.randn(kvh, blocks * bs, dim, generator=g) * 3 for _ in range(2))
    tables = torch.stack([torch.randperm(blocks, generator=g)[:8] for _ in range(n)])
    ctx = torch.tensor([3, 17, 9, 32, 1])
    return k, v, quantize_kv(k), quantize_kv(v), tables, ctx, bs


def _reference(q, k, v, tables, ctx, bs, starts, qlens, scale, window, softcap):
    """Each query row over its context's keys and values ([kv_heads, slots, dim]), as plain softmax attention."""
    heads, kvh = q.shape[1], k.shape[0]
    out = torch.empty_like(q)
    for r in range(len(ctx)):
        for i in range(int(qlens[r])):
            pos = int(ctx[r] - qlens[r] + i)
            keys = torch.arange(max(0, pos + 1 - window) if window else 0, pos + 1)
            slots = tables[r, keys // bs] * bs + keys % bs
            for h in range(heads):
                s = (k[h * kvh // heads, slots] @ q[starts[r] + i, h]) * scale
                if softcap:
                    s = softcap * torch.tanh(s / softcap)
                out[starts[r] + i, h] = torch.softmax(s, 0) @ v[h * kvh // heads, slots]
    return out


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (5, 0.0), (0, 2.0)])
@pytest.mark.parametrize("dim", [64, 24])  # 512-bit kernels, and the generic ones (a dim not a multiple of 16)
def test_decode_and_prefill_kernels_attend_over_the_rows_values(dim, window, softcap):
    k, v, k8, v8, tables, ctx, bs = _paged(dim)
    kernel, scale = native.load(), dim**-0.5
    exact_k, exact_v = dequantize_kv(k8), dequantize_kv(v8)
    q = torch.randn(len(ctx), 6, dim)
    out = torch.empty_like(q)
    kernel.paged_decode(q, k8, v8, tables, ctx, out, scale, window, bs, softcap, None)
    ones = torch.ones(len(ctx), dtype=torch.long)
    want = _reference(q, exact_k, exact_v, tables, ctx, bs, torch.arange(len(ctx)), ones, scale, window, softcap)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-5)
    qlens = torch.minimum(ctx, torch.tensor([3, 5, 1, 9, 1]))
    starts = torch.cumsum(qlens, 0) - qlens
    qp = torch.randn(int(qlens.sum()), 6, dim)
    out = torch.empty_like(qp)
    kernel.paged_prefill(qp, k8, v8, tables, ctx, qlens, starts, out, scale, window, bs, softcap, None)
    want = _reference(qp, exact_k, exact_v, tables, ctx, bs, starts, qlens, scale, window, softcap)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="cache rows of the queries' dim"):  # int8 rows without their scales
        kernel.paged_decode(q, k8[..., :-4].contiguous(), v8[..., :-4].contiguous(), tables, ctx, out[: len(ctx)],
                            scale, 0, bs, 0.0, None)


def llama():
    return scaled_tiny(T.LlamaConfig, T.LlamaForCausalLM, num_key_value_heads=2)  # the one-call decoder


async def run(model, work, **config) -> list[list[int]]:
    return await engine_tokens(model, work, **{"kv_cache_dtype": "int8", **config})


MODELS = {  # (scaled: rounding the keys and values changes tokens)
    "llama": llama,
    "mistral window": lambda: scaled_tiny(T.MistralConfig, T.MistralForCausalLM, num_key_value_heads=1,
                                          sliding_window=8),
    "gemma2 softcap": lambda: scaled_tiny(T.Gemma2Config, T.Gemma2ForCausalLM, num_key_value_heads=2, head_dim=16,
                                          attn_logit_softcapping=8.0, sliding_window=8, tie_word_embeddings=False,
                                          query_pre_attn_scalar=16),
    "phi3": lambda: scaled_tiny(T.Phi3Config, T.Phi3ForCausalLM, num_key_value_heads=2),  # packed linears, torch layers
}


@pytest.mark.parametrize("fuse", [None, False], ids=["default", "not fused"])
@pytest.mark.parametrize("name", list(MODELS))
async def test_tokens_are_close_to_generates_over_the_same_rounding(name, fuse):
    """Tokens are not `generate`'s bit for bit (a code rounds the other way for an input one bit apart, and greedy
    text then parts): what is owed is agreement at most positions and on each request's first token (these tiny
    models' tokens all agree today, SmolLM2's start-up probes differ by 2% of the logits' scale)."""
    model = MODELS[name]()
    work = random_requests(8, model.config.vocab_size, max_prompt=40, max_new=20, seed=3)
    fp32 = [reference(model, p, n) for p, n in work]
    with RoundedKV(model, torch.int8):
        rounded = [reference(model, p, n) for p, n in work]
    assert rounded != fp32, "the workload should tell an int8 cache from an fp32 one"
    served = await run(model, work, fuse_cpu_layers=fuse)
    same = sum(a == b for s, r in zip(served, rounded) for a, b in zip(s, r)) / sum(map(len, rounded))
    assert same >= 0.9 and all(s[0] == r[0] for s, r in zip(served, rounded)), same


async def test_int8_cache_is_batch_invariant_deterministic_and_unchanged_by_chunking_and_speculation():
    model = llama()
    work = random_requests(6, model.config.vocab_size, max_prompt=40, max_new=16, seed=5)
    together = await run(model, work, speculative_tokens=0)
    assert await run(model, work, speculative_tokens=0) == together
    assert [(await run(model, [w], speculative_tokens=0))[0] for w in work] == together
    assert await run(model, work, max_batch_tokens=5, speculative_tokens=0) == together  # prompts chunked differently
    assert await run(model, work, speculative_tokens=3) == together


async def test_int8_cache_tokens_survive_prefix_sharing_and_offload():
    model = llama()
    shared = random_requests(1, model.config.vocab_size, max_prompt=30, max_new=1, seed=8)[0][0]
    work = [(shared[: 12 + i], n) for i, (_, n) in enumerate(random_requests(8, 256, max_new=24, seed=9))]
    alone = await run(model, work, allow_block_sharing=False)
    assert await run(model, work) == alone  # prefixes shared (the default): the shared blocks' rows and scales
    tight = dict(num_blocks=24, max_batch_tokens=32, safety_margin=0.0, allow_block_sharing=False)
    assert await run(model, work, cpu_offload_space=0.01, **tight) == alone  # rows and scales to the host and back
    assert await run(model, work, **tight) == alone  # soft resets


def test_int8_cache_holds_nearly_four_times_fp32s_tokens(monkeypatch):
    from jitney.cache import sizing

    monkeypatch.setattr(sizing, "available_memory", lambda device: 4 << 20)
    model = tiny_llama()
    fp32, int8 = (Engine(model, config=EngineConfig(block_size=4, kv_cache_dtype=kv)).cache for kv in (None, "int8"))
    dim = model.config.hidden_size // model.config.num_attention_heads
    assert int8.keys[0].dtype == torch.int8 and int8.keys[0].shape[-1] == dim + 4
    ratio = 4 * dim / (dim + 4)  # a row's bytes: 4 dim against dim codes and a 4-byte scale
    assert abs((int8.num_blocks + 2) / (fp32.num_blocks + 2) - ratio) < 0.02 * ratio


async def test_int8_cache_is_refused_where_the_attention_cannot_read_it():
    model = tiny_llama()
    with pytest.raises(ValueError, match="kv_cache_dtype='int8': the attention backend 'torch' does not read an int8 "
                                         "cache under float32 queries"):
        async with Engine(model, config=EngineConfig(kv_cache_dtype="int8", attention_backend="torch")):
            pass
    half = tiny_llama().to(torch.bfloat16)  # unlike bf16, not the dtype a bf16 model's attention computes in
    with pytest.raises(ValueError, match="does not read an int8 cache under bfloat16 queries"):
        async with Engine(half, config=EngineConfig(kv_cache_dtype="int8", attention_backend="torch")):
            pass
    async with Engine(model, config=EngineConfig(kv_cache_dtype="int8")) as engine:  # nothing bound by the refusals
        assert (await engine.generate(Request([5, 6, 7], SamplingParams(max_new_tokens=3)))).token_ids


def test_quality_scores_an_int8_cache(tmp_path):
    import json

    from jitney.cli import main as cli

    out = tmp_path / "quality.json"
    assert cli(["quality", "--weights", "fp32,fp32+kvint8", "--tokens", "200", "--window", "100",
                "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["weights"] for r in rows] == ["fp32", "fp32+kvint8"]
    assert abs(rows[1]["perplexity_vs_first"]) < 0.03 and rows[1]["top1_same_as_first"] > 0.9


def test_smollm2_answers_over_an_int8_cache(smollm2):
    """The embedded model passes the start-up check over an int8 cache (its reference rounds keys and values as the
    cache does) and answers as over an fp32 one."""
    from jitney import LLM

    model, tokenizer = smollm2
    prompt = "The capital of France is"
    plain, rounded = (LLM(model, EngineConfig(num_blocks=64, kv_cache_dtype=kv), tokenizer=tokenizer)
                      .generate(prompt, SamplingParams(max_new_tokens=8), progress=False)[0] for kv in (None, "int8"))
    assert "Paris" in rounded.text and rounded.token_ids[:4] == plain.token_ids[:4]
