"""int8 weights (`EngineConfig(weights="int8")`): greedy tokens are `generate`'s with every linear's weight rounded
as the int8 path rounds it (so the int8 kernels add only float rounding), deterministic and batch-invariant; the
int8 model is refused where it cannot run, and speculation still gives its own tokens. "w8a8" (int8 activations
too): its linears match torch's rounding of weights and inputs, and it is deterministic and batch-invariant.
"bf16" (weights rounded to bfloat16, fp32 rows): the same, against `generate` over the bf16-rounded weights."""

from __future__ import annotations

import pytest
import torch
import transformers as T
from support import engine_tokens, random_requests, reference, scaled_tiny

from jitney import Engine, EngineConfig, Request, SamplingParams
from jitney.kernels import cpu_linear, native

pytestmark = pytest.mark.skipif(not native.available(), reason="int8 weights need jitney's C++ kernels")

MODELS = {  # (scaled: the rounding of the weights changes tokens, so the test tells int8 from fp32)
    "llama": lambda: scaled_tiny(T.LlamaConfig, T.LlamaForCausalLM, num_key_value_heads=2),  # the one-call decoder
    "qwen2 biases": lambda: scaled_tiny(T.Qwen2Config, T.Qwen2ForCausalLM, num_key_value_heads=2, vary_vectors=True),
    "mistral window": lambda: scaled_tiny(T.MistralConfig, T.MistralForCausalLM, num_key_value_heads=1, sliding_window=8),
    "phi3": lambda: scaled_tiny(T.Phi3Config, T.Phi3ForCausalLM, num_key_value_heads=2),  # packed linears, torch layers
}


async def run(model, work, **config) -> list[list[int]]:
    """Greedy tokens of `work` through an int8 engine (`config` overrides)."""
    return await engine_tokens(model, work, **{"weights": "int8", **config})


@pytest.mark.parametrize("weights", ["int8", "w8a8", "bf16"])
@pytest.mark.parametrize("name", list(MODELS))
async def test_quantized_tokens_are_generates_with_the_rounded_weights(name, weights):
    model = MODELS[name]()
    work = random_requests(8, model.config.vocab_size, max_prompt=40, max_new=20, seed=3)
    fp32 = [reference(model, p, n) for p, n in work]
    with cpu_linear.QuantizedReference(model, weights):
        rounded = [reference(model, p, n) for p, n in work]
    assert rounded != fp32, "the workload should tell int8 from fp32 weights"
    assert await run(model, work, weights=weights) == rounded
    # the model's own weights are untouched
    assert [reference(model, p, n) for p, n in work] == fp32


async def test_bf16_weights_of_a_checkpoint_published_in_bf16_give_fp32s_tokens():
    model = MODELS["llama"]()
    with torch.no_grad():  # as a bf16 checkpoint loaded in fp32: every weight a bf16 value
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    work = random_requests(6, model.config.vocab_size, max_prompt=40, max_new=16, seed=7)
    assert await run(model, work, weights="bf16") == [reference(model, p, n) for p, n in work]


@pytest.mark.parametrize("weights", ["int8", "w8a8", "bf16"])
@pytest.mark.parametrize("name", ["llama", "phi3"])
async def test_quantized_is_batch_invariant_and_deterministic(weights, name):
    model = MODELS[name]()
    work = random_requests(6, model.config.vocab_size, max_prompt=40, max_new=16, seed=5)
    together = await run(model, work, weights=weights)
    alone = [(await run(model, [w], weights=weights))[0] for w in work]
    assert together == alone
    assert await run(model, work, max_batch_tokens=5, weights=weights) == together  # prompts chunked differently


async def test_int8_speculation_gives_the_same_tokens():
    model = MODELS["llama"]()
    work = random_requests(3, model.config.vocab_size, max_prompt=20, max_new=24, seed=9)
    async with Engine(model, config=EngineConfig(weights="int8")) as engine:
        assert engine.speculate == 0  # off by default: the draft would be the model itself
    assert await run(model, work, speculative_tokens=3) == await run(model, work)


async def test_int8_is_refused_where_it_cannot_run():
    model = MODELS["llama"]()
    with pytest.raises(ValueError, match="pack_cpu_weights=False"):
        async with Engine(model, config=EngineConfig(weights="int8", pack_cpu_weights=False)):
            pass
    half = MODELS["llama"]().to(torch.bfloat16)
    with pytest.raises(ValueError, match="no fp32 linear layers"):
        async with Engine(half, config=EngineConfig(weights="int8")):
            pass
    with pytest.raises(ValueError, match="weights"):
        EngineConfig(weights="int4")
    narrow = scaled_tiny(T.LlamaConfig, T.LlamaForCausalLM, hidden_size=48, num_key_value_heads=2)
    with pytest.raises(ValueError, match="blocks of 32 inputs, and model.layers.0.self_attn.q_proj takes 48"):
        async with Engine(narrow, config=EngineConfig(weights="w8a8")):
            pass
    # refused when built, nothing bound: the model serves afterwards
    async with Engine(model, config=EngineConfig(weights="int8")) as engine:
        assert (await engine.generate(Request([5, 6, 7], SamplingParams(max_new_tokens=3)))).token_ids


def test_int8_linear_matches_its_reference():
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(40, 24, generator=g), torch.randn(40, generator=g)
    linear = cpu_linear.PanelLinear([w[:8], w[8:]], b, quantized="int8")
    x = torch.randn(3, 5, 24, generator=g)
    torch.testing.assert_close(linear(x), x @ cpu_linear.int8_rounded(w).T + b, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="gated"):
        cpu_linear.PanelLinear([w[:16], w[16:32]], None, gated=True, quantized="int8")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int8_rounding_is_torchs_per_feature(dtype):
    """`int8_weights` (C++, one pass a feature) rounds as torch does over the widened weight: each feature on its
    largest magnitude / 127, to nearest even (ties included), an all-zero feature on scale 1."""
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(37, 64, generator=g) * torch.rand(37, 1, generator=g) * 4).to(dtype)
    w[9] = 0
    w[4, :3] = torch.tensor([127.0, 0.5, -1.5])  # (on scale 1: ties, to even)
    q, scale = cpu_linear.int8_weights(w)
    whole = w.float()
    top = whole.abs().amax(1, keepdim=True)
    expected = torch.where(top > 0, top / 127, torch.ones_like(top))
    assert torch.equal(scale, expected.reshape(-1)) and scale[9] == 1 and scale[4] == 1
    assert torch.equal(q, (whole / expected).round().clamp(-127, 127).to(torch.int8))
    assert q[4, :3].tolist() == [127, 0, -2]


@pytest.mark.parametrize("gated, compute, n", [(False, "fp32", 40), (False, "bf16", 40), (True, "fp32", 64),
                                               (True, "bf16", 64)])
def test_the_draft_packs_from_bf16_panels_as_from_the_weights(gated, compute, n):
    """A bf16 linear's int8 copy (the speculative draft's) made straight from its packed panels (plain, VNNI pairs,
    gated MLP's in turns, a last panel part-filled) is `pack_int8` of its weights stacked, byte for byte."""
    g = torch.Generator().manual_seed(3)
    weights = [torch.randn(n // 2, 64, generator=g).to(torch.bfloat16) for _ in range(2)]
    linear = cpu_linear.PanelLinear(weights, None, gated=gated, compute=compute)
    assert linear.packed.dim() == (4 if compute == "bf16" else 3)
    from_panels = native.load().int8_from_panels(linear.packed, linear.width, gated)
    assert torch.equal(from_panels, cpu_linear.pack_int8(weights))


@pytest.mark.parametrize("rows", [1, 2, 5, 7, 13, 40])
def test_w8a8_linear_matches_its_reference(rows):
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(72, 96, generator=g), torch.randn(72, generator=g)  # (72: a panel of 16 left over)
    w[5] = 0
    linear = cpu_linear.PanelLinear([w[:40], w[40:]], b, quantized="w8a8")
    x = torch.randn(rows, 96, generator=g)
    x[0, :32] = 0  # a block of zeros
    x[-1, 40] = 50.0  # an outlier: its block's other inputs round coarsely, the other blocks' do not
    y = linear(x)
    ref = cpu_linear.int8_activations(x) @ cpu_linear.int8_rounded(w).T + b
    torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-5)
    alone = torch.cat([linear(x[i : i + 1]) for i in range(rows)])
    assert torch.equal(y, alone)  # each row's outputs whatever the rows computed with it
    with pytest.raises(RuntimeError, match="multiple of 32"):
        cpu_linear.PanelLinear([torch.randn(16, 48)], None, quantized="w8a8")


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 13, 40, 300])
@pytest.mark.parametrize("gated", [False, True])
def test_bf16_linear_is_fp32_over_the_rounded_weights(rows, gated):  # (and fp16 weights, packed as they are)
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(96, 70, generator=g), torch.randn(96, generator=g)  # (96: six panels; 70: no multiple of 16)
    x = torch.randn(rows, 70, generator=g)
    half = cpu_linear.rounded(w, "bf16")
    assert not torch.equal(half, w) and torch.equal(half, w.to(torch.bfloat16).float())
    if gated:
        linear = cpu_linear.PanelLinear([w[:48], w[48:]], b, gated=True, quantized="bf16")
        same = cpu_linear.PanelLinear([half[:48], half[48:]], b, gated=True)
    else:
        linear = cpu_linear.PanelLinear([w[:40], w[40:]], b, quantized="bf16")
        same = cpu_linear.PanelLinear([half], b)
        torch.testing.assert_close(linear(x), x @ half.T + b, atol=1e-5, rtol=1e-5)
    assert linear.packed.dtype == torch.bfloat16  # (half the bytes of fp32 panels)
    assert torch.equal(linear(x), same(x))  # the fp32 kernel's very sums, over the rounded weights
    fp16 = w.half()
    blocks = [fp16[:48], fp16[48:]]
    linear = cpu_linear.PanelLinear(blocks, b, gated=gated) if gated else cpu_linear.PanelLinear(blocks, b)
    widened = [t.float() for t in blocks]
    same = cpu_linear.PanelLinear(widened, b, gated=gated) if gated else cpu_linear.PanelLinear(widened, b)
    assert linear.packed.dtype == torch.float16 and torch.equal(linear(x), same(x))
