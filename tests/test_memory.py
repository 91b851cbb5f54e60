"""`Engine.memory()`: what an engine holds, by part, each tensor counted once: the model's weights, jitney's packed
copies, the draft and the screen only where they are built, the KV cache reserved and in use."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from support import tiny_llama
from transformers import LlamaConfig, LlamaForCausalLM

from jitney import Engine, EngineConfig, Request, SamplingParams
from jitney.core.models import load_model
from jitney.kernels import native

pytestmark = pytest.mark.skipif(not native.available(), reason="the packed parts need jitney's C++ kernels")


def param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # (parameters() gives a tied one once)


async def test_each_part_is_counted_where_it_is_built():
    model = tiny_llama()
    config = dict(num_blocks=64, block_size=4)
    linears = sum(m.weight.numel() * 4 for m in model.modules() if isinstance(m, torch.nn.Linear))
    layers = sum(m.weight.numel() * 4 for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear))
    own = param_bytes(model)
    async with Engine(model, config=EngineConfig(**config)) as engine:
        use = engine.memory()
        assert use.weights == own - layers  # the layers' linears held by their packed copies only
        assert linears <= use.packed <= linears * 1.2  # every linear packed (panels padded to 16 outputs)
        assert use.draft > 0 and use.draft < use.packed / 2  # int8: about a quarter
        assert use.screen > 0 if engine.executor.decoder.screened else use.screen == 0
        assert use.kv_reserved == engine.cache.bytes_allocated and use.kv_in_use == 0
        async with engine.stream(Request([5, 6, 7, 8, 9], SamplingParams(max_new_tokens=8))) as stream:
            async for _ in stream:
                assert engine.memory().kv_in_use > 0  # (the request's blocks, while it runs)
                break
        assert use.total == use.weights + use.packed + use.draft + use.screen + use.kv_reserved
        assert "weights" in use.describe() and "KV reserved" in use.describe()
    async with Engine(model, config=EngineConfig(**config, speculative_tokens=0, lm_head_screen=False)) as engine:
        use = engine.memory()
        assert use.draft == 0 and use.screen == 0 and use.packed > 0  # (built only where used)
    async with Engine(model, config=EngineConfig(**config, pack_cpu_weights=False)) as engine:
        assert engine.memory().packed == 0


async def test_a_bf16_computes_copy_is_half_an_fp32_one():
    model = tiny_llama()
    async with Engine(model, config=EngineConfig(num_blocks=64, block_size=4)) as engine:
        fp32 = engine.memory().packed
    async with Engine(model, config=EngineConfig(num_blocks=64, block_size=4, compute="bf16")) as engine:
        bf16 = engine.memory().packed
    head = model.lm_head.weight.numel() * 4  # (the LM head stays fp32)
    assert bf16 - head == pytest.approx((fp32 - head) / 2, rel=0.05)


@pytest.mark.parametrize("dtype, compute", [(torch.float32, "fp32"), (torch.bfloat16, "bf16"), (torch.float32, "bf16")])
async def test_packed_copies_hold_the_layers_weights_instead_of_the_model(dtype, compute):
    """Exact packed copies (fp32 panels; a bf16 model's bf16 ones, VNNI pairs too) replace the layers' weights
    while an engine runs, and exit puts them back bit for bit; a copy rounded to bf16 cannot, and the weight stays."""
    model = tiny_llama().to(dtype)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    layers = [m for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    exact = dtype == torch.bfloat16 or compute == "fp32"
    config = EngineConfig(num_blocks=64, block_size=4, compute=compute)
    async with Engine(model, config=config) as engine:
        assert all(m.weight.numel() == 0 for m in layers) if exact else all(m.weight.numel() > 0 for m in layers)
        assert model.lm_head.weight.numel() > 0  # (the screen and the draft read the head)
        assert engine.memory().draft > 0  # (the draft was packed from the packed copies)
        async with engine.stream(Request([5, 6, 7, 8, 9], SamplingParams(max_new_tokens=4))) as stream:
            assert len([t async for t in stream]) == 4
    for name, p in model.named_parameters():
        assert p.dtype == before[name].dtype and torch.equal(p, before[name]), name


async def test_speculation_is_off_by_default_where_its_draft_would_not_fit(monkeypatch, caplog):
    """By default the int8 draft is packed only where it, the whole KV cache and a margin fit in the memory
    available (a model near the machine's size serves without it, saying so); asked for, it is packed anyway."""
    model = tiny_llama()
    config = dict(num_blocks=64, block_size=4)
    async with Engine(model, config=EngineConfig(**config, speculative_tokens=0)) as engine:
        estimate = engine.executor.decoder.draft_bytes()  # (the draft not packed: from the shapes)
        cache = engine.cache.bytes_allocated
    async with Engine(model, config=EngineConfig(**config)) as engine:
        assert engine.speculate > 0 and engine.memory().draft == pytest.approx(estimate, rel=0.1)
    free = estimate + cache + (1 << 30) - 1
    monkeypatch.setattr("jitney.core.engine.available_memory", lambda device: free)
    with caplog.at_level(logging.WARNING, logger="jitney"):
        async with Engine(model, config=EngineConfig(**config)) as engine:
            assert engine.speculate == 0 and engine.memory().draft == 0
    assert "speculative decoding off" in caplog.text
    async with Engine(model, config=EngineConfig(**config, speculative_tokens=4)) as engine:
        assert engine.speculate == 4 and engine.memory().draft > 0


def test_a_half_precision_checkpoint_too_large_to_widen_loads_as_it_is(tmp_path, monkeypatch, caplog):
    """`load_model` widens a bf16 checkpoint to fp32 (`generate`'s reference) where that fits, loads it straight in
    its own type where not (saying so), and in whatever type it is asked for."""
    from jitney.core.models import load_model

    tiny_llama().to(torch.bfloat16).save_pretrained(tmp_path)
    assert {p.dtype for p in load_model(tmp_path)[0].parameters()} == {torch.float32}
    assert {p.dtype for p in load_model(tmp_path, dtype=torch.bfloat16)[0].parameters()} == {torch.bfloat16}
    monkeypatch.setattr("jitney.cache.sizing.available_memory", lambda device: 1 << 20)
    with caplog.at_level(logging.WARNING, logger="jitney"):
        assert {p.dtype for p in load_model(tmp_path)[0].parameters()} == {torch.bfloat16}
    assert "would not fit" in caplog.text
    assert {p.dtype for p in load_model(tmp_path, dtype=torch.float32)[0].parameters()} == {torch.float32}


def resident(path) -> int:
    """Bytes of `path`'s mappings resident in this process (/proc/self/smaps)."""
    total, ours = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's first line
                ours = len(fields) > 5 and fields[5] == str(path)
            elif ours and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads the mappings' resident pages from /proc")
async def test_weights_given_up_leave_the_checkpoints_mapping(tmp_path):
    """A checkpoint's weights are mapped from its file: a weight given up to its packed copy frees none of it while
    the embedding holds the file, so the pages its packing read are paged out; exit puts the very tensors back
    (nothing unpacked into fresh pages), their pages read again from the file as they are used."""
    torch.manual_seed(0)
    shaped = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=2048, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, bos_token_id=None,
                                          eos_token_id=None, pad_token_id=0)).eval()
    shaped.save_pretrained(tmp_path)
    checkpoint = tmp_path / "model.safetensors"
    model, _ = load_model(tmp_path)
    layers = [m for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    given_up = sum(m.weight.nbytes for m in layers)
    where = {name: p.data_ptr() for name, p in model.named_parameters()}
    before = {name: p.detach().clone() for name, p in model.named_parameters()}  # (every page of the file read)
    assert resident(checkpoint) >= given_up  # (a mapping of the file: else this tests nothing)
    async with Engine(model, config=EngineConfig(num_blocks=64, block_size=4)) as engine:
        assert all(m.weight.numel() == 0 for m in layers)
        assert resident(checkpoint) < given_up / 10  # (the embedding, the head, the norms and the pages beside them)
        assert len(kept(engine)) == len(layers)
        async with engine.stream(Request([5, 6, 7, 8, 9], SamplingParams(max_new_tokens=4))) as stream:
            assert len([t async for t in stream]) == 4
    assert resident(checkpoint) < given_up / 10
    for name, p in model.named_parameters():
        assert p.data_ptr() == where[name] and torch.equal(p, before[name]), name


async def test_weights_not_mapped_from_a_file_are_unpacked_back():
    """A model built in memory holds its weights on the heap: given up, they are freed, and exit unpacks them from
    the packed copies into tensors of their own, bit for bit."""
    model = tiny_llama()
    layers = [m for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    before = [m.weight.detach().clone() for m in layers]
    async with Engine(model, config=EngineConfig(num_blocks=64, block_size=4)) as engine:
        assert all(m.weight.numel() == 0 for m in layers)
        assert kept(engine) == []  # (nothing held on to: the packed copies hold the weights alone)
    assert all(torch.equal(m.weight, w) for m, w in zip(layers, before))


def kept(engine) -> list:
    """The given-up weights an entered engine holds on to (`cpu_linear.kept_if_mapped`)."""
    return [w for path in engine._cpu_paths for *_, weights in getattr(path, "released", []) for w in weights or ()]
