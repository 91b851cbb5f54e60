"""The embedded SmolLM2: real prompts give the same greedy tokens as `generate`; the sync façade; the CLI."""

from __future__ import annotations

import subprocess
import sys

import anyio
import pytest
import torch

from jitney import LLM, Engine, EngineConfig, Request, SamplingParams

PROMPTS = ["Once upon a time, there was a little", "The capital of France is", "def fibonacci(n):"]


def reference(model, tokenizer, prompt: str, n: int) -> list[int]:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=n, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


async def test_smollm2_matches_generate(smollm2):
    model, tokenizer = smollm2
    refs = [reference(model, tokenizer, p, 24) for p in PROMPTS]
    results = {}
    async with Engine(model, tokenizer, EngineConfig(max_batch_tokens=8, num_blocks=64)) as engine:
        async def one(i: int) -> None:
            results[i] = await engine.generate(Request(PROMPTS[i], SamplingParams(max_new_tokens=24)))

        async with anyio.create_task_group() as tg:
            for i in range(len(PROMPTS)):
                tg.start_soon(one, i)
    for i, ref in enumerate(refs):
        assert results[i].token_ids == ref
    assert results[0].text.startswith(" girl named Emma")


async def test_streamed_text_adds_up_to_the_completion(smollm2):
    model, tokenizer = smollm2
    async with Engine(model, tokenizer, EngineConfig(num_blocks=64)) as engine:
        stream = engine.stream(Request("Once upon a time", SamplingParams(max_new_tokens=30)))
        async with stream:
            text = "".join([t.text async for t in stream])
        assert text == stream.completion().text


def test_llm_facade(smollm2):
    model, tokenizer = smollm2
    llm = LLM(model, EngineConfig(num_blocks=64), tokenizer=tokenizer)
    out = llm.generate(PROMPTS[:2], SamplingParams(max_new_tokens=10), progress=False)
    assert [o.token_ids for o in out] == [reference(model, tokenizer, p, 10) for p in PROMPTS[:2]]
    with pytest.raises(ValueError, match="empty"):
        llm.generate(["fine", ""], progress=False)
    assert llm.generate("again", SamplingParams(max_new_tokens=3), progress=False)[0].finish_reason == "length"


def test_cli_streams_an_answer():
    cli = [sys.executable, "-m", "jitney.cli"]
    run = subprocess.run(cli + ["generate", "What is the capital of France?", "--max-new-tokens", "12"],
                         capture_output=True, text=True, timeout=300, cwd="/")
    assert run.returncode == 0, run.stderr
    assert "Paris" in run.stdout
    bad = subprocess.run(cli + ["generate", "hi", "--model", "/no/such/model"], capture_output=True, text=True, timeout=300, cwd="/")
    assert bad.returncode == 2
    assert "no model" in bad.stderr
