"""Packed weights kept on disk (`EngineConfig.packed_cache`, `kernels/stored.py`): the first start writes what it
packed, a later start of the same weights maps it instead of packing, with the same tokens; a file that is not whole
is packed again; other weights or another packing never map it."""

from __future__ import annotations

import os
import shutil
import time

import pytest
import torch
from support import engine_tokens, random_requests, reference, tiny_llama

from jitney import Engine, EngineConfig, Request, SamplingParams
from jitney.kernels import native
from jitney.kernels.stored import HEADER, SPARE, PackedStore

pytestmark = pytest.mark.skipif(not native.available(), reason="packed weights need jitney's C++ kernels")


@pytest.fixture
def home(tmp_path, monkeypatch):
    """The packed weights' directory in `tmp_path` (not the kernels': they would build again)."""
    monkeypatch.setattr("jitney.core.engine.cache_dir", lambda: tmp_path)
    return tmp_path / "packed"


def test_a_key_names_the_bytes_shapes_and_packing():
    store = PackedStore("unused")
    w = torch.randn(32, 64)
    key = store.key("panels", [w], gated=False)
    assert store.key("panels", [w.clone()], gated=False) == key
    changed = w.clone()
    changed[31, 63] += 1e-6
    assert store.key("panels", [changed], gated=False) != key  # one weight's last bit
    assert store.key("panels", [w], gated=True) != key
    assert store.key("panels", [w.view(64, 32)], gated=False) != key
    assert store.key("panels", [w.to(torch.bfloat16)], gated=False) != key
    assert store.derived(key, "int8") != key


def test_a_rounded_copy_is_named_by_the_weights_it_was_rounded_from(tmp_path):
    """Two fp32 weights that round to the same bf16 ones: their bf16 copies are the same, but the draft's int8 copies
    (named from theirs) are made from the fp32 weights, so the names differ."""
    from jitney.kernels.cpu_linear import PanelLinear

    store = PackedStore(tmp_path)
    w = torch.randn(32, 64)
    near = w.clone()
    near[0, 0] = torch.nextafter(w[0, 0], torch.tensor(float("inf")))
    assert torch.equal(w.to(torch.bfloat16), near.to(torch.bfloat16))
    a, b = (PanelLinear([x], None, quantized="bf16", store=store) for x in (w, near))
    assert torch.equal(a.packed, b.packed) and a.key != b.key


def test_written_then_mapped_copy_on_write(tmp_path):
    store = PackedStore(tmp_path)
    t = torch.randn(3, 40, 16)
    assert store.fetch("k", lambda: t) is t and store.mapped == 0
    store.write_in_background()
    store.close(finish=True)
    assert store.written == t.numel() * 4
    again = PackedStore(tmp_path)
    mapped = again.fetch("k", lambda: pytest.fail("packed again"))
    assert torch.equal(mapped, t) and again.mapped == t.numel() * 4 and not again.pending
    mapped.zero_()  # (copy on write: the file keeps its bytes)
    assert torch.equal(PackedStore(tmp_path).load("k"), t)


def test_a_file_cut_short_is_packed_again(tmp_path):
    store = PackedStore(tmp_path)
    store.fetch("k", lambda: torch.ones(1000))
    store.write_in_background()
    store.close(finish=True)
    path = store.path("k")
    path.write_bytes(path.read_bytes()[:-4])
    again = PackedStore(tmp_path)
    assert torch.equal(again.fetch("k", lambda: torch.full((1000,), 2.0)), torch.full((1000,), 2.0))
    assert again.pending and again.mapped == 0
    path.write_bytes(b"not a header")
    assert PackedStore(tmp_path).load("k") is None


def test_closing_without_finishing_leaves_whole_files_only(tmp_path):
    store = PackedStore(tmp_path)
    for i in range(4):
        store.fetch(f"k{i}", lambda: torch.ones(2**20))
    store.write_in_background()
    store.close()  # (may stop between files or inside one)
    store = PackedStore(tmp_path)
    store.fetch("empty", lambda: torch.ones(0))
    store.write_in_background()
    store.close(finish=True)
    assert torch.equal(PackedStore(tmp_path).load("empty"), torch.ones(0))
    for path in (p for p in tmp_path.iterdir() if p.stem != "empty"):
        assert path.suffix == ".bin" and path.stat().st_size == HEADER + 2**22


@pytest.mark.parametrize("dtype, compute", [(torch.float32, "fp32"), (torch.bfloat16, "bf16")])
async def test_a_second_start_maps_what_the_first_wrote(home, dtype, compute):
    model = tiny_llama().to(dtype)
    work = random_requests(4, model.config.vocab_size, max_new=12, seed=1)
    config = dict(num_blocks=64, compute=compute)
    plain = await engine_tokens(model, work, **config)
    assert await engine_tokens(model, work, **config, packed_cache=True) == plain  # (packs, writes)
    files = sorted(home.iterdir())
    assert files and all(f.suffix == ".bin" for f in files)
    async with Engine(model, config=EngineConfig(**config, packed_cache=True, max_batch_tokens=16,
                                                 block_size=4)) as engine:
        store = engine._store
        use = engine.memory()
        assert use.screen > 0  # (the screen's int8 parts mapped too; its weights are the model's)
        assert store.mapped == use.packed + use.draft + use.screen - sum(  # every packed copy mapped, biases aside
            t.numel() * t.element_size() for p in engine._cpu_paths for t in p.tensors if t.dim() == 1)
        assert not store.pending
    assert sorted(home.iterdir()) == files  # nothing new written
    assert await engine_tokens(model, work, **config, packed_cache=True) == plain
    if dtype == torch.float32:
        prompt, n = work[0]
        assert plain[0] == reference(model, prompt, n)
    # the model's weights are its own again after a mapped start
    assert all(p.numel() > 0 for p in model.parameters())


async def test_other_weights_never_map_them(home):
    first, second = tiny_llama(seed=0), tiny_llama(seed=1)
    async with Engine(first, config=EngineConfig(num_blocks=64, packed_cache=True)):
        pass
    written = len(list(home.iterdir()))
    prompt = [5, 6, 7, 8]
    expected = reference(second, prompt, 8)
    async with Engine(second, config=EngineConfig(num_blocks=64, packed_cache=True)) as engine:
        assert engine._store.mapped == 0
        out = await engine.generate(Request(prompt, SamplingParams(max_new_tokens=8, ignore_eos=True)))
        assert out.token_ids == expected
    assert len(list(home.iterdir())) == 2 * written


async def test_a_directory_that_cannot_be_written_costs_a_warning_only(tmp_path, monkeypatch, caplog):
    (tmp_path / "packed").write_text("a file where the directory would be")
    monkeypatch.setattr("jitney.core.engine.cache_dir", lambda: tmp_path)
    model = tiny_llama()
    prompt = [5, 6, 7, 8]
    expected = reference(model, prompt, 6)
    async with Engine(model, config=EngineConfig(num_blocks=64, packed_cache=True)) as engine:
        out = await engine.generate(Request(prompt, SamplingParams(max_new_tokens=6, ignore_eos=True)))
        assert out.token_ids == expected
    assert "packed weights not written" in caplog.text


def test_files_half_written_by_a_dead_process_are_removed(tmp_path):
    old, fresh = tmp_path / "a.bin.1.2.part", tmp_path / "b.bin.3.4.part"
    old.write_bytes(b"x")
    fresh.write_bytes(b"y")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    store = PackedStore(tmp_path)
    store.fetch("k", lambda: torch.ones(4))
    store.write_in_background()
    store.close(finish=True)
    assert not old.exists() and fresh.exists()  # (one being written now: kept)


def test_the_room_stale_files_held_counts_as_free(tmp_path, monkeypatch):
    stale = tmp_path / "a.bin.1.2.part"
    stale.write_bytes(b"x")
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    room = 64 * 4 + 4096 + SPARE  # (what one 64-float tensor needs, with the spare the store leaves)

    def usage(path):  # (a disk whose free space is short of it until the stale file is gone)
        return shutil._ntuple_diskusage(10 * room, 9 * room, room - 1 + (0 if stale.exists() else 2))

    monkeypatch.setattr("jitney.kernels.stored.shutil.disk_usage", usage)
    store = PackedStore(tmp_path)
    store.fetch("k", lambda: torch.ones(64))
    store.write_in_background()
    store.close(finish=True)
    assert not stale.exists() and store.written == 64 * 4


def written(root, limit: int, *keys: str, floats: int = 2**18) -> PackedStore:
    """A store over `root` that wrote a tensor of `floats` floats for each of `keys`."""
    store = PackedStore(root, limit=limit)
    for key in keys:
        store.fetch(key, lambda: torch.ones(floats))
    store.write_in_background()
    store.close(finish=True)
    return store


def test_the_directory_keeps_within_its_limit_the_files_used_longest_ago_removed_first(tmp_path, caplog):
    one = 2**20  # (a file's bytes on disk: 2**18 floats after a header that is a hole)
    written(tmp_path, 10 * one, "a", "b", "c")
    for age, key in ((300, "a"), (200, "b"), (100, "c")):
        os.utime(tmp_path / f"{key}.bin", (time.time() - age, time.time() - age))
    assert PackedStore(tmp_path).load("a") is not None  # a start maps a: used now
    caplog.set_level("INFO", logger="jitney.stored")
    written(tmp_path, int(3.5 * one), "d")  # room for three files and a bit
    assert sorted(p.stem for p in tmp_path.glob("*.bin")) == ["a", "c", "d"]  # b, used longest ago, made room
    assert "removed 1 packed weights files used longest ago" in caplog.text
    # a store that maps c never removes it, though it was used longest ago now
    store = PackedStore(tmp_path, limit=int(2.5 * one))
    assert store.load("c") is not None and store.fetch("e", lambda: torch.ones(2**18)) is not None
    os.utime(tmp_path / "c.bin", (time.time() - 500, time.time() - 500))
    store.write_in_background()
    store.close(finish=True)
    assert sorted(p.stem for p in tmp_path.glob("*.bin")) == ["c", "e"]


def test_what_would_pass_the_limit_alone_is_not_written(tmp_path, caplog, monkeypatch):
    written(tmp_path, 2**30, "a")
    store = written(tmp_path, 2**19, "big")  # (more than the limit by itself)
    assert store.written == 0 and not (tmp_path / "big.bin").exists() and (tmp_path / "a.bin").exists()
    assert "would take it past its limit of 0.00 GiB" in caplog.text
    # what would fit the limit alone but not beside the files a store maps: nothing removed either
    store = PackedStore(tmp_path, limit=int(1.5 * 2**20))
    assert store.load("a") is not None and store.fetch("b", lambda: torch.ones(2**18)) is not None
    (tmp_path / "c.bin").write_bytes(b"\0" * 2**19)  # (a file of another model's, used longest ago)
    os.utime(tmp_path / "c.bin", (time.time() - 500, time.time() - 500))
    store.write_in_background()
    store.close(finish=True)
    assert (tmp_path / "c.bin").exists() and not (tmp_path / "b.bin").exists() and store.written == 0
    monkeypatch.setenv("JITNEY_PACKED_GIB", "1.5")
    assert PackedStore(tmp_path).limit == int(1.5 * 2**30)
    monkeypatch.setenv("JITNEY_PACKED_GIB", "lots")
    assert PackedStore(tmp_path).limit == 32 * 2**30 and "is not a number of GiB" in caplog.text
