"""Test helpers: tiny random models built from a config, reference outputs, random workloads."""

from __future__ import annotations

import random
import socket
import threading
import time
from contextlib import contextmanager

import torch
import uvicorn
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM


def scaled_tiny(config_class, model_class, scale: float = 5.0, vary_vectors: bool = False, **kw):
    """A tiny random model of any architecture, its weights scaled up: at the default initialisation attention
    features hide (soft-caps and rope scaling change no token). `vary_vectors`: biases and norm weights, which
    start all zeros or all ones, get noise too (by little: larger biases make GPT-2 and Gemma repeat
    themselves)."""
    torch.manual_seed(0)
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=512, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    model = model_class(config_class(**{**base, **kw})).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
            if vary_vectors and p.dim() == 1:
                p.add_(torch.randn_like(p), alpha=0.1)
    return model


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )
    return LlamaForCausalLM(config).eval()


def flat_head_llama() -> LlamaForCausalLM:
    """A tiny Llama of 8,192 tokens whose LM head rows are all but equal: every feature's int8 copy the same, so no
    row can be screened (more than 4,096 candidates), each takes every logit, and the decoder's screen rests."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=None,
                                         eos_token_id=None, pad_token_id=0)).eval()
    with torch.no_grad():
        model.lm_head.weight.copy_(model.lm_head.weight[0] + torch.randn(8192, 64) * 1e-7)
    return model


def tiny_mistral(seed: int = 0, window: int = 8) -> MistralForCausalLM:
    torch.manual_seed(seed)
    config = MistralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=512, sliding_window=window, bos_token_id=None,
        eos_token_id=None, pad_token_id=0,
    )
    return MistralForCausalLM(config).eval()


def reference(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy fp32 tokens from `model.generate` (the tiny models have no end-of-sequence token)."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


async def engine_tokens(model, work, **config) -> list[list[int]]:
    """Greedy tokens of `work` ((prompt, new tokens) pairs, all submitted at once, EOS ignored) through one engine;
    `config`: `EngineConfig` fields (blocks of 4 and 16 tokens a step unless given)."""
    import anyio

    from jitney import Engine, EngineConfig, Request, SamplingParams

    out: dict[int, list[int]] = {}
    async with Engine(model, config=EngineConfig(**{"max_batch_tokens": 16, "block_size": 4, **config})) as engine:
        async def one(i: int) -> None:
            prompt, n = work[i]
            out[i] = (await engine.generate(Request(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True)))).token_ids

        async with anyio.create_task_group() as tg:
            for i in range(len(work)):
                tg.start_soon(one, i)
    return [out[i] for i in range(len(work))]


async def finish(engine, request):
    """Run `request` through `engine` to its end, a failed one too: its completion says why."""
    from jitney.core.stream import finished

    return await finished(engine.stream(request))


async def complete_all(engine, requests) -> list:
    """`requests` submitted at once to `engine`; their completions (`finish`), in order."""
    import anyio

    out = {}

    async def one(i: int) -> None:
        out[i] = await finish(engine, requests[i])

    async with anyio.create_task_group() as tg:
        for i in range(len(requests)):
            tg.start_soon(one, i)
    return [out[i] for i in range(len(requests))]


def random_requests(n: int, vocab: int, max_prompt: int = 60, max_new: int = 24, seed: int = 0):
    rng = random.Random(seed)
    return [([rng.randrange(3, vocab) for _ in range(rng.randint(1, max_prompt))], rng.randint(1, max_new)) for _ in range(n)]


def _tiny(name: str, seed: int, config_name: str | None = None, **kw):
    """transformers' `{name}ForCausalLM` at the tiny models' size (vocabulary 256, hidden 64, two layers, four
    heads, no end-of-sequence token), seeded, its config `{config_name or name}Config`; `kw` overrides or adds
    config fields."""
    import transformers

    torch.manual_seed(seed)
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    config = getattr(transformers, f"{config_name or name}Config")(**{**base, **kw})
    return getattr(transformers, f"{name}ForCausalLM")(config).eval()


def _vary_norms(model, mean: float = 0.0, std: float = 0.5):
    """RMSNorm weights drawn around `mean` so that they count (Gemma's norms multiply by 1 + weight, which starts
    at zero; others' weights start at one)."""
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__.endswith("RMSNorm"):
                m.weight.normal_(mean, std)
    return model


def tiny_gemma2(seed: int = 0, window: int = 8):
    """Alternating sliding-window and full-attention layers (soft-capping off)."""
    return _tiny("Gemma2", seed, num_hidden_layers=4, head_dim=16, sliding_window=window, attn_logit_softcapping=None,
                 final_logit_softcapping=None, query_pre_attn_scalar=16)


def tiny_gemma2_capped(seed: int = 0, window: int = 8):
    """`tiny_gemma2` with its attention scores soft-capped at 1, its logits at 2 (which changes them, not the
    greedy tokens), its matrices scaled up by 5 so that the attention cap changes its tokens (8 of the 10
    requests of the fused tests), norm weights varied, the head untied (a random model whose head is tied to the
    embedding, scaled up by sqrt(hidden), echoes its last token)."""
    model = _vary_norms(_tiny("Gemma2", seed, num_hidden_layers=4, head_dim=16, sliding_window=window,
                              attn_logit_softcapping=1.0, final_logit_softcapping=2.0, query_pre_attn_scalar=16,
                              tie_word_embeddings=False))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(5.0)
    return model


def tiny_gemma3(seed: int = 0, window: int = 8, **kw):
    """Gemma3's text model: two local layers (a sliding window of 8, rotary base 10,000) and a global one (base
    1,000,000), each kind with angles of its own; per-head query and key norms; norms of the attention's and the
    MLP's outputs; GeLU (tanh); norm weights varied, the head untied (see `tiny_gemma2_capped`)."""
    config = dict(num_hidden_layers=3, head_dim=16, sliding_window=window, query_pre_attn_scalar=16,
                  layer_types=["sliding_attention", "sliding_attention", "full_attention"], tie_word_embeddings=False)
    return _vary_norms(_tiny("Gemma3", seed, config_name="Gemma3Text", **{**config, **kw}))


def tiny_olmo2(seed: int = 0):
    """Norms of the attention's and the MLP's outputs only, queries and keys normalised across all heads at once
    (OLMo2's), the norm weights varied so that they count."""
    return _vary_norms(_tiny("Olmo2", seed), mean=1.0)


def tiny_granite(seed: int = 0):
    """Granite's multipliers: embeddings x 4, attention scores x 1 (not head_dim ** -0.5), the attention's and the
    MLP's outputs x 0.5 before the residual, logits / 2."""
    return _tiny("Granite", seed, embedding_multiplier=4.0, logits_scaling=2.0, residual_multiplier=0.5,
                 attention_multiplier=1.0)


def tiny_smollm3(seed: int = 0):
    """SmolLM3: every second layer without the rotary embedding (here: the second of two)."""
    return _tiny("SmolLM3", seed, no_rope_layer_interval=2)


def tiny_qwen2(seed: int = 0):
    """Biases on q/k/v (Qwen2's attention)."""
    model = _tiny("Qwen2", seed)
    with torch.no_grad():  # random init leaves the biases at zero: make them count
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return model


def tiny_qwen3(seed: int = 0):
    """Per-head query and key norms (Qwen3's attention), their weights varied so that they count."""
    model = _tiny("Qwen3", seed, head_dim=16)
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.normal_(1, 0.5)
    return model


def tiny_phi3(seed: int = 0):
    """q/k/v and gate/up each one linear already (Phi3's), a sliding window of 8."""
    return _tiny("Phi3", seed, sliding_window=8)


@contextmanager
def serving(app, lifespan: str = "on"):
    """`app` on a free loopback port, in a thread; yields its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan=lifespan))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not srv.started:
        assert time.time() < deadline, "server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(timeout=30)
