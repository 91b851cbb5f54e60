"""The start-up check: a model jitney cannot run faithfully is refused when the engine is entered, with the
model class and the reason, and left as it was; models it runs pass."""

from __future__ import annotations

import pytest
import transformers as T
from support import reference, scaled_tiny

from jitney import Engine, EngineConfig, Request, SamplingParams
from jitney.core.hooks import hookimpl
from jitney.core import selfcheck
from jitney.core.selfcheck import UnfaithfulModel
from jitney.kernels import native
from jitney.kernels.torch_paged import TorchPagedAttention


def tiny(config_class, model_class, **kw):
    return scaled_tiny(config_class, model_class, **kw)


REFUSED = {
    "falcon": (lambda: tiny(T.FalconConfig, T.FalconForCausalLM, num_kv_heads=4, new_decoder_architecture=False),
               # (transformers < / >= 5.25)
               "never reaches jitney's attention function|do not pass the step's data down"),
    "stablelm": (lambda: tiny(T.StableLmConfig, T.StableLmForCausalLM, num_key_value_heads=2),
                 "do not pass the step's data down"),
}

FEATURED = {  # models whose attention has a feature beyond causal attention (tests/test_attention_features.py)
    "gpt-oss": lambda: tiny(T.GptOssConfig, T.GptOssForCausalLM, num_key_value_heads=2, num_local_experts=4,
                            num_experts_per_tok=2, head_dim=16, sliding_window=8,
                            layer_types=["sliding_attention", "full_attention"]),
    # scores scaled by 1 and capped at 2: the cap changes this tiny model's tokens (Gemma2's own 50 would not)
    "gemma2 soft-capped": lambda: tiny(T.Gemma2Config, T.Gemma2ForCausalLM, num_key_value_heads=2, head_dim=16,
                                       sliding_window=8, query_pre_attn_scalar=1, attn_logit_softcapping=2.0),
}


@pytest.mark.parametrize("backend", [None, "torch"])
@pytest.mark.parametrize("name", list(REFUSED))
async def test_a_model_jitney_cannot_run_faithfully_is_refused_at_entry(name, backend):
    make, reason = REFUSED[name]
    model = make()
    before = model.config._attn_implementation
    prompt = [5, 6, 7, 8]
    ref = reference(model, prompt, 4)
    engine = Engine(model, config=EngineConfig(num_blocks=32, attention_backend=backend))
    with pytest.raises(UnfaithfulModel, match=reason) as refusal:
        async with engine:
            pass
    assert type(model).__name__ in str(refusal.value)
    assert not engine.healthy
    assert model.config._attn_implementation == before
    assert reference(model, prompt, 4) == ref  # the model is as it was


async def test_a_model_it_runs_passes_the_check():
    model = tiny(T.LlamaConfig, T.LlamaForCausalLM, num_key_value_heads=2)
    ref = reference(model, [5, 6, 7, 8], 6)
    async with Engine(model, config=EngineConfig(num_blocks=32)) as engine:
        out = await engine.generate(Request([5, 6, 7, 8], SamplingParams(max_new_tokens=6, ignore_eos=True)))
        assert engine.num_free_blocks == 32  # the check gave its blocks back
    assert out.token_ids == ref


async def test_a_cache_too_small_for_the_check_skips_it_with_a_warning(caplog):
    model = tiny(T.LlamaConfig, T.LlamaForCausalLM, num_key_value_heads=2)
    async with Engine(model, config=EngineConfig(num_blocks=1, block_size=4)) as engine:
        assert engine.healthy
    assert any("too small to check" in r.getMessage() for r in caplog.records)


class PlainBackend:
    """A third-party backend written before soft-capping and sinks: its steps take neither keyword."""

    @hookimpl
    def jitney_register_attention_backends(self, register):
        register("plain", lambda device: self)

    def prepare(self, step):
        attend = TorchPagedAttention().prepare(step)
        return lambda layer, query, key, value, scaling, window: attend(layer, query, key, value, scaling, window)


@pytest.mark.parametrize("name, feature", [("gpt-oss", "attention sinks"),
                                           ("gemma2 soft-capped", "attention logit soft-capping")])
async def test_a_backend_without_a_feature_the_model_uses_refuses_it(name, feature):
    model = FEATURED[name]()
    engine = Engine(model, config=EngineConfig(num_blocks=32, attention_backend="plain"), plugins=[PlainBackend()])
    with pytest.raises(UnfaithfulModel, match=f"attention backend does not support {feature}"):
        async with engine:
            pass
    assert not engine.healthy


class ScaledBackend:
    """A faulty third-party backend: every output three times what attention gives."""

    @hookimpl
    def jitney_register_attention_backends(self, register):
        register("scaled", lambda device: self)

    def prepare(self, step):
        attend = TorchPagedAttention().prepare(step)

        def scaled(*args, **features):
            return 3 * attend(*args, **features)

        scaled.supports = getattr(attend, "supports", frozenset())
        return scaled


@pytest.mark.skipif(not native.available(), reason="int8 weights need jitney's C++ kernels")
async def test_a_refusal_under_quantized_weights_names_the_likely_cause(monkeypatch):
    """Measured against the format's own reference; where the served rows lie about as far from it as the format
    moves the model's logits, quantization is named, and an error well past that is put on attention."""
    model = tiny(T.LlamaConfig, T.LlamaForCausalLM, num_key_value_heads=2)
    faulty = Engine(model, config=EngineConfig(num_blocks=32, weights="w8a8", attention_backend="scaled"),
                    plugins=[ScaledBackend()])
    with pytest.raises(UnfaithfulModel, match="not the quantization alone .*w8a8 weights alone move them by") as refusal:
        async with faulty:
            pass
    assert "attention feature" in str(refusal.value)
    monkeypatch.setattr(selfcheck, "tolerance", lambda engine: -1.0)  # a bound no path meets
    with pytest.raises(UnfaithfulModel, match="likely cause: quantization.*serve it without int8 weights"):
        async with Engine(model, config=EngineConfig(num_blocks=32, weights="int8")):
            pass
    monkeypatch.undo()
    async with Engine(model, config=EngineConfig(num_blocks=32, weights="w8a8")) as engine:  # the real bound
        assert engine.healthy
