"""Fused CPU decoder layers: each C++ piece against transformers' own, and whole runs equal to `generate`."""

from __future__ import annotations

import anyio
import pytest
import torch
import torch.nn.functional as F
from support import (_tiny, random_requests, reference, tiny_gemma2, tiny_gemma2_capped, tiny_gemma3, tiny_granite,
                     tiny_mistral, tiny_olmo2, tiny_phi3, tiny_qwen2, tiny_qwen3, tiny_smollm3)
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from jitney import Engine, EngineConfig, Request, SamplingParams
from jitney.kernels import cpu_layers, native


@pytest.fixture(scope="module")
def kernels():
    if not native.available():
        pytest.fail("the C++ CPU kernels do not build here")
    return native.load()


@pytest.mark.parametrize("rows", [1, 3, 300])
def test_rms_norm_matches_transformers_with_and_without_residual(kernels, rows):
    norm = LlamaRMSNorm(96, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    x, r = torch.randn(rows, 96), torch.randn(rows, 96)
    with torch.inference_mode():
        out, same = kernels.rms_norm(x, None, norm.weight, 1e-5)
        torch.testing.assert_close(out, norm(x), atol=1e-5, rtol=1e-5)
        assert same is x
        out, total = kernels.rms_norm(x, r, norm.weight, 1e-5)
        torch.testing.assert_close(total, x + r)
        torch.testing.assert_close(out, norm(x + r), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 5, 400])
def test_rotary_in_place_matches_transformers(kernels, rows):
    heads, kv_heads, dim = 4, 2, 16
    y = torch.randn(rows, (heads + 2 * kv_heads) * dim)
    angles = torch.randn(rows, dim // 2)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    q = y[:, : heads * dim].view(1, rows, heads, dim).transpose(1, 2)
    k = y[:, heads * dim : (heads + kv_heads) * dim].view(1, rows, kv_heads, dim).transpose(1, 2)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos[None], sin[None])
    v = y[:, (heads + kv_heads) * dim :].clone()
    kernels.rotary_(y, cos, sin, heads + kv_heads)
    torch.testing.assert_close(q, want_q, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(k, want_k, atol=1e-6, rtol=1e-5)
    assert torch.equal(y[:, (heads + kv_heads) * dim :], v)  # values are not turned


@pytest.mark.parametrize("rows", [1, 3, 300])
@pytest.mark.parametrize("whole", [False, True], ids=["per head (Qwen3)", "all heads (OLMo2)"])
def test_query_and_key_norms_match_transformers(kernels, rows, whole):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    heads, kv_heads, d = 4, 2, 16
    q_norm = Qwen3RMSNorm(heads * d if whole else d, eps=1e-6)
    k_norm = Qwen3RMSNorm(kv_heads * d if whole else d, eps=1e-6)
    with torch.no_grad():
        q_norm.weight.normal_(1, 0.5)
        k_norm.weight.normal_(1, 0.5)
    y = torch.randn(rows, (heads + 2 * kv_heads) * d)  # q, k, v heads of each row
    ref = y.clone()
    parts = (rows, 1, -1) if whole else (rows, -1, d)
    ref[:, : heads * d] = q_norm(y[:, : heads * d].reshape(parts)).reshape(rows, -1)
    ref[:, heads * d : (heads + kv_heads) * d] = k_norm(y[:, heads * d : (heads + kv_heads) * d].reshape(parts)).reshape(rows, -1)
    kernels.head_norm_(y, heads * d, kv_heads * d, q_norm.weight.detach(), k_norm.weight.detach(), 1e-6)
    torch.testing.assert_close(y, ref, atol=1e-6, rtol=1e-5)  # (the values untouched too)
    with pytest.raises(RuntimeError, match="head_norm_"):
        kernels.head_norm_(y, heads * d, kv_heads * d, torch.ones(d), torch.ones(d + 1), 1e-6)


@pytest.mark.parametrize("seed", range(4))
def test_gated_activations_match_torch(kernels, seed):
    gu = torch.randn(7, 2 * 50, generator=torch.Generator().manual_seed(seed)) * 4
    gu[0, :8] = torch.tensor([-100.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 100.0, 3.0])  # (both tails and around 0)
    gate, up = gu[:, :50], gu[:, 50:]
    torch.testing.assert_close(kernels.gated_act(gu), F.silu(gate) * up, atol=1e-6, rtol=1e-5)
    # (the kernel's x / (1 + exp(-2u)) and torch's 0.5 x (1 + tanh(u)) are each within 7e-7 of float64 over
    # [-12, 12], apart by up to 1.4e-6, times up's values of up to ~16)
    torch.testing.assert_close(kernels.gated_act(gu, 1), F.gelu(gate, approximate="tanh") * up, atol=1e-5, rtol=1e-5)


def test_kernels_refuse_what_they_do_not_handle(kernels):
    with pytest.raises(RuntimeError, match="contiguous fp32"):
        kernels.rms_norm(torch.randn(2, 8, dtype=torch.float64), None, torch.randn(8, dtype=torch.float64), 1e-5)
    with pytest.raises(RuntimeError, match="heads"):
        kernels.rotary_(torch.randn(2, 16), torch.randn(2, 8), torch.randn(2, 8), 3)
    with pytest.raises(RuntimeError, match=r"\[T, 2I\]"):
        kernels.gated_act(torch.randn(2, 7))


async def _run(model, work, **config):
    results = {}
    config = EngineConfig(num_blocks=200, block_size=4, max_batch_tokens=24, **config)
    async with Engine(model, config=config) as engine:
        layer = model.model.layers[0]
        fused = "forward" in vars(layer)
        if fused:  # its linears are computed by the fused layer, not packed one by one as well
            assert not any("forward" in vars(m) for m in layer.modules() if isinstance(m, torch.nn.Linear))

        async def one(i, prompt, n):
            results[i] = (await engine.generate(Request(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True)))).token_ids

        async with anyio.create_task_group() as tg:
            for i, (prompt, n) in enumerate(work):
                tg.start_soon(one, i, prompt, n)
    assert "forward" not in vars(model.model.layers[0])  # the class's forward again
    return [results[i] for i in range(len(work))], fused


FUSED = {"llama": None, "mistral": tiny_mistral, "qwen2": tiny_qwen2, "qwen3": tiny_qwen3, "phi3": tiny_phi3,
         "gemma2": tiny_gemma2, "gemma2 capped": tiny_gemma2_capped, "gemma3": tiny_gemma3, "olmo2": tiny_olmo2,
         "granite": tiny_granite, "smollm3": tiny_smollm3}


@pytest.mark.parametrize("make", list(FUSED.values()), ids=list(FUSED))
async def test_fused_layers_match_generate_and_leave_the_model_as_it_was(llama, make, kernels, monkeypatch):
    model = llama if make is None else make()
    mixed = []  # steps with prefill chunks, each in one call too
    real = cpu_layers.FusedDecoder.step
    monkeypatch.setattr(cpu_layers.FusedDecoder, "step", lambda self, *a: mixed.append(a[2].num_decodes) or real(self, *a))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    work = random_requests(10, 256, max_prompt=40, max_new=12, seed=3)
    refs = [reference(model, p, n) for p, n in work]
    got, fused = await _run(model, work, fuse_cpu_layers=True)
    assert fused
    assert got == refs
    assert mixed and max(mixed) > 0  # prompts chunked (24 tokens a step), some steps with decodes beside them
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    assert [reference(model, p, n) for p, n in work[:2]] == refs[:2]


@pytest.mark.parametrize("make, field, neutral", [(tiny_gemma2_capped, "final_logit_softcapping", None),
                                                  (tiny_granite, "logits_scaling", 1.0)], ids=["soft-capped", "divided"])
async def test_decoder_logits_are_the_models(kernels, monkeypatch, make, field, neutral):
    # (what the head does to the logits changes them, not the greedy tokens: the logits themselves compared)
    model = make()
    logits = []
    real = cpu_layers.FusedDecoder.step
    # (each step's logits beside what it returns: greedy steps return their tokens)
    monkeypatch.setattr(cpu_layers.FusedDecoder, "step",
                        lambda self, *a: logits.append(real(self, *a[:4], lambda: None)) or real(self, *a))
    prompt = list(range(3, 23))
    await _run(model, [(prompt, 1)], fuse_cpu_layers=True)
    with torch.inference_mode():
        want = model(torch.tensor([prompt])).logits[0, -1]
        setattr(model.config, field, neutral)
        assert not torch.allclose(model(torch.tensor([prompt])).logits[0, -1], want, atol=1e-2)  # (it counts)
    torch.testing.assert_close(logits[-1][-1], want, atol=1e-4, rtol=1e-4)  # (the last step: the prompt)


async def test_unsupported_layers_run_as_they_are(kernels):
    model = _tiny("Cohere", 0)  # (LayerNorms, attention and MLP side by side)
    assert not cpu_layers.supported(model.model.layers[0])
    work = random_requests(4, 256, max_prompt=20, max_new=8, seed=5)
    refs = [reference(model, p, n) for p, n in work]
    got, fused = await _run(model, work, fuse_cpu_layers=True)
    assert not fused
    assert got == refs


async def test_partial_rotary_runs_layer_by_layer(kernels):
    # the rotary kernel turns whole heads: a Phi3 rotating half of each head is not fused, and still exact
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    model = Phi3ForCausalLM(Phi3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, rope_parameters=rope,
                                       bos_token_id=None, eos_token_id=None, pad_token_id=0)).eval()
    assert not cpu_layers.supported(model.model.layers[0])
    work = random_requests(3, 256, max_prompt=20, max_new=8, seed=4)
    got, fused = await _run(model, work, fuse_cpu_layers=True)
    assert not fused
    assert got == [reference(model, p, n) for p, n in work]


async def test_fusing_off_keeps_transformers_layers(llama):
    work = random_requests(3, 256, max_prompt=20, max_new=6, seed=7)
    got, fused = await _run(llama, work, fuse_cpu_layers=False)
    assert not fused
    assert got == [reference(llama, p, n) for p, n in work]


@pytest.mark.parametrize("make", list(FUSED.values()), ids=list(FUSED))
@pytest.mark.parametrize("streams", [1, 7])
async def test_decode_steps_run_the_whole_model_in_one_call_and_match_generate(llama, make, streams, kernels, monkeypatch):
    model = llama if make is None else make()
    calls = []
    real = cpu_layers.FusedDecoder.__call__
    monkeypatch.setattr(cpu_layers.FusedDecoder, "__call__", lambda self, *a: calls.append(1) or real(self, *a))
    work = random_requests(streams, 256, max_prompt=30, max_new=40, seed=11)
    work = [(p, 30 + n) for p, n in work]  # long enough for the mistral window (8) to slide
    refs = [reference(model, p, n) for p, n in work]
    # (plain decode steps: speculative and prompt-lookup ones have tests of their own)
    got, fused = await _run(model, work, fuse_cpu_layers=True, speculative_tokens=0, lookup_tokens=0)
    assert fused
    assert got == refs
    assert len(calls) >= 30  # the decode steps went through it


async def test_decoder_is_not_used_with_another_attention_backend(llama, kernels, monkeypatch):
    calls = []
    real = cpu_layers.FusedDecoder.__call__
    monkeypatch.setattr(cpu_layers.FusedDecoder, "__call__", lambda self, *a: calls.append(1) or real(self, *a))
    work = random_requests(1, 256, max_prompt=10, max_new=10, seed=13)
    got, fused = await _run(llama, work, fuse_cpu_layers=True, attention_backend="torch")
    assert fused and not calls  # the layers still run fused, through the chosen backend
    assert got == [reference(llama, p, n) for p, n in work]


def test_argmax_rows_matches_torch_with_ties_and_nan(kernels):
    x = torch.randn(2, 5000)
    x[0, 10] = x[0, 20] = 1e9  # a tie: the first one
    x[1, 30] = x[1, 40] = float("nan")  # NaN above all, the first one
    assert kernels.argmax_rows(x) == x.argmax(-1).tolist() == [10, 30]


@pytest.mark.parametrize("n", [1, 7, 15, 16, 17, 24, 100, 49152])
def test_argmax_rows_matches_torch_on_many_ties(kernels, n):
    # few distinct values: ties within a lane of eight, across lanes and in the tail; -inf rows; a NaN late
    g = torch.Generator().manual_seed(n)
    x = torch.randint(0, 5, (6, n), generator=g).float()
    x[1] = float("-inf")
    x[2, -1] = 9.0  # the largest last
    x[3, n // 2] = float("nan")
    x[4, 0] = x[4, -1] = float("nan")  # the first of two
    assert kernels.argmax_rows(x) == x.argmax(-1).tolist()
