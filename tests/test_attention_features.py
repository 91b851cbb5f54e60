"""Attention soft-capping (Gemma2) and attention sinks (GPT-OSS) in every built-in backend: the same greedy tokens
as `model.generate`, for requests of different lengths batched together, whole or with prompts split across steps."""

from __future__ import annotations

import copy

import anyio
import pytest
import torch
from support import reference
from test_model_check import FEATURED

from jitney import Engine, EngineConfig, Request, SamplingParams

PROMPT_LENGTHS = (3, 10, 19, 33)
NEW_TOKENS = 10


def without_feature(name: str, model):
    """The same model with its attention feature turned off."""
    plain = copy.deepcopy(model)
    for layer in plain.model.layers:
        if name == "gpt-oss":
            with torch.no_grad():
                layer.self_attn.sinks.fill_(float("-inf"))  # a sink of weight exp(-inf) = 0
        else:
            layer.self_attn.attn_logit_softcapping = None
    return plain


@pytest.fixture(scope="module", params=list(FEATURED))
def featured(request):
    """(model, its prompts, their reference tokens)."""
    model = FEATURED[request.param]()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    refs = [reference(model, p, NEW_TOKENS) for p in prompts]
    # not vacuous: without the feature the model says something else
    plain = without_feature(request.param, model)
    assert [reference(plain, p, NEW_TOKENS) for p in prompts] != refs
    return model, prompts, refs


@pytest.mark.parametrize("max_batch_tokens", [256, 16], ids=["whole", "chunked"])
@pytest.mark.parametrize("backend", [None, "torch", "triton"])  # None: the default, `cpu` here
async def test_tokens_match_generate(featured, backend, max_batch_tokens):
    model, prompts, refs = featured
    config = EngineConfig(attention_backend=backend, block_size=4, num_blocks=128, max_batch_tokens=max_batch_tokens)
    done = {}

    async def one(i, prompt):
        request = Request(prompt, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
        done[i] = (await engine.generate(request)).token_ids

    async with Engine(model, config=config) as engine, anyio.create_task_group() as tg:
        for i, prompt in enumerate(prompts):
            tg.start_soon(one, i, prompt)
    assert [done[i] for i in range(len(prompts))] == refs
