"""The architecture matrix: each supported architecture, in each mode (the default backend, the torch backend,
prompts chunked across steps), gives the same greedy tokens as `model.generate` for requests of different lengths
batched together, or is refused at entry with its reason. The tiny random models are scaled up so that every
feature they have (rope scaling, soft-caps, sliding windows, tied embeddings, ...) changes the tokens."""

from __future__ import annotations

import functools

import anyio
import pytest
import torch
import transformers as T
from support import reference, scaled_tiny

from jitney import Engine, EngineConfig, Request, SamplingParams
from jitney.core.selfcheck import UnfaithfulModel

PROMPT_LENGTHS = (3, 9, 17, 40)  # past the sliding windows (8) and past `max_batch_tokens=16`
NEW_TOKENS = 10
WINDOW = 8


def tiny(config_class, model_class, scale=5.0, **kw):
    return scaled_tiny(config_class, model_class, scale, vary_vectors=True, **kw)


LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 32,
          "low_freq_factor": 1.0, "high_freq_factor": 4.0}  # (32: every wavelength past 32 positions is scaled)
# Gemma's head is tied to an embedding scaled up by sqrt(hidden): at random weights (any scale) the embedding
# dominates the residual and the model echoes its last token. Untied, it says varied things.
GEMMA = dict(num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
GEMMA2 = dict(GEMMA, query_pre_attn_scalar=16, sliding_window=WINDOW)

MODELS = {
    "llama": lambda **kw: tiny(T.LlamaConfig, T.LlamaForCausalLM, num_key_value_heads=2, **kw),
    "llama llama3-rope": lambda **kw: tiny(T.LlamaConfig, T.LlamaForCausalLM, num_key_value_heads=2,
                                           **{"rope_parameters": LLAMA3, **kw}),
    "llama tied": lambda **kw: tiny(T.LlamaConfig, T.LlamaForCausalLM, num_key_value_heads=2,
                                    **{"tie_word_embeddings": True, **kw}),
    "mistral": lambda **kw: tiny(T.MistralConfig, T.MistralForCausalLM, num_key_value_heads=1,
                                 **{"sliding_window": WINDOW, **kw}),
    "qwen2": lambda **kw: tiny(T.Qwen2Config, T.Qwen2ForCausalLM, num_key_value_heads=2, **kw),
    "qwen3": lambda **kw: tiny(T.Qwen3Config, T.Qwen3ForCausalLM, num_key_value_heads=2, head_dim=16, **kw),
    "qwen3-moe": lambda **kw: tiny(T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM, num_key_value_heads=2, head_dim=16,
                                   num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, **kw),
    "mixtral": lambda **kw: tiny(T.MixtralConfig, T.MixtralForCausalLM, num_key_value_heads=2, num_local_experts=4,
                                 num_experts_per_tok=2, **kw),
    "gemma": lambda **kw: tiny(T.GemmaConfig, T.GemmaForCausalLM, **GEMMA, **kw),
    "gemma2": lambda **kw: tiny(T.Gemma2Config, T.Gemma2ForCausalLM, **{**GEMMA2, "attn_logit_softcapping": None,
                                                                       "final_logit_softcapping": None, **kw}),
    # The attention cap is far below Gemma2's 50: attention logits here stay under 50, and a cap they never
    # reach changes nothing. (The final cap keeps Gemma2's 30: it never changes the greedy token.)
    "gemma2 soft-capped": lambda **kw: tiny(T.Gemma2Config, T.Gemma2ForCausalLM,
                                            **{**GEMMA2, "attn_logit_softcapping": 1.0, **kw}),
    "gemma3 text": lambda **kw: tiny(T.Gemma3TextConfig, T.Gemma3ForCausalLM, **{
        **GEMMA2, "layer_types": ["sliding_attention", "full_attention"], **kw}),
    "phi3": lambda **kw: tiny(T.Phi3Config, T.Phi3ForCausalLM, num_key_value_heads=2, **kw),
    "gpt2": lambda **kw: tiny(T.GPT2Config, T.GPT2LMHeadModel, **kw),
    "gpt-neox": lambda **kw: tiny(T.GPTNeoXConfig, T.GPTNeoXForCausalLM, **kw),
    "opt": lambda **kw: tiny(T.OPTConfig, T.OPTForCausalLM, ffn_dim=128, **kw),
    "falcon": lambda **kw: tiny(T.FalconConfig, T.FalconForCausalLM, num_kv_heads=4, new_decoder_architecture=False,
                                **kw),
    "stablelm": lambda **kw: tiny(T.StableLmConfig, T.StableLmForCausalLM, num_key_value_heads=2, **kw),
    "olmo2": lambda **kw: tiny(T.Olmo2Config, T.Olmo2ForCausalLM, num_key_value_heads=2, **kw),
    "granite": lambda **kw: tiny(T.GraniteConfig, T.GraniteForCausalLM, num_key_value_heads=2, **{
        "embedding_multiplier": 4.0, "logits_scaling": 2.0, "residual_multiplier": 0.5, "attention_multiplier": 1.0,
        **kw}),
    "cohere": lambda **kw: tiny(T.CohereConfig, T.CohereForCausalLM, num_key_value_heads=2, use_qk_norm=True, **kw),
    "smollm3": lambda **kw: tiny(T.SmolLM3Config, T.SmolLM3ForCausalLM, num_key_value_heads=2,
                                 no_rope_layer_interval=2, **kw),  # its second layer has no rotary embedding
    "gpt-oss": lambda **kw: tiny(T.GptOssConfig, T.GptOssForCausalLM, num_key_value_heads=2, num_local_experts=4,
                                 num_experts_per_tok=2, head_dim=16, sliding_window=WINDOW,
                                 max_position_embeddings=131072,  # (what its YaRN rope scaling expects)
                                 layer_types=["sliding_attention", "full_attention"], **kw),
}

REFUSED = {  # architecture: what the refusal says
    # (Falcon's attention joined transformers' registry in 5.25, but its decoder layer drops the step's data)
    "falcon": "never reaches jitney's attention function|do not pass the step's data down",
    "stablelm": "do not pass the step's data down",
}

FEATURES = {  # feature: the architecture that has it, and the config that turns it off (same weights otherwise)
    "llama3 rope scaling": ("llama llama3-rope", dict(rope_parameters=None)),
    "tied embeddings": ("llama tied", dict(tie_word_embeddings=False)),
    "mistral sliding window": ("mistral", dict(sliding_window=None)),
    "gemma2 sliding window": ("gemma2", dict(sliding_window=512)),
    "gemma3 sliding window": ("gemma3 text", dict(sliding_window=512)),
    "gemma2 soft-capping": ("gemma2 soft-capped", dict(attn_logit_softcapping=None, final_logit_softcapping=None)),
    "granite multipliers": ("granite", dict(embedding_multiplier=1.0, logits_scaling=1.0, residual_multiplier=1.0,
                                            attention_multiplier=0.25)),  # (Llama's scaling: head_dim ** -0.5)
}

MODES = {
    "default": EngineConfig(block_size=4, num_blocks=128),
    "torch": EngineConfig(block_size=4, num_blocks=128, attention_backend="torch"),
    "chunked": EngineConfig(block_size=4, num_blocks=128, max_batch_tokens=16),
}


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@functools.cache
def model_and_references(name: str):
    """The model (built once for the three modes) and its `generate` tokens for each prompt."""
    model = MODELS[name]()
    refs = [reference(model, p, NEW_TOKENS) for p in prompts()]
    # not saturated: the random model says varied things, so a wrong attention shows in its tokens
    assert all(len(set(r)) >= 4 for r in refs), refs
    return model, refs


async def serve(model, config: EngineConfig) -> list[list[int]]:
    done = {}

    async def one(i, prompt):
        request = Request(prompt, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
        done[i] = (await engine.generate(request)).token_ids

    async with Engine(model, config=config) as engine, anyio.create_task_group() as tg:
        for i, prompt in enumerate(prompts()):
            tg.start_soon(one, i, prompt)
    return [done[i] for i in range(len(done))]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", list(MODELS))
async def test_tokens_match_generate_or_the_model_is_refused(name, mode):
    model, refs = model_and_references(name)
    if name in REFUSED:
        with pytest.raises(UnfaithfulModel, match=REFUSED[name]) as refusal:
            await serve(model, MODES[mode])
        assert type(model).__name__ in str(refusal.value)
    else:
        assert await serve(model, MODES[mode]) == refs


@pytest.mark.parametrize("feature", list(FEATURES))
def test_each_feature_changes_the_tokens(feature):
    """Not vacuous: were the engine to ignore the feature, the matrix above would see other tokens."""
    name, off = FEATURES[feature]
    _, refs = model_and_references(name)
    plain = MODELS[name](**off)
    assert [reference(plain, p, NEW_TOKENS) for p in prompts()] != refs
