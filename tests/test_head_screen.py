"""The LM head's screen (`HeadScreen` in `kernels/cpu/head_screen.h`): greedy tokens from int8 logits with bounds, fp32
logits only where the bounds leave a doubt; always the argmax of every fp32 logit, as `panel_rows` computes them."""

from __future__ import annotations

import json

import pytest
import torch
from support import (engine_tokens, flat_head_llama, random_requests, reference, tiny_gemma2_capped, tiny_granite,
                     tiny_llama)

from jitney.cli import main as cli
from jitney.kernels import cpu_layers, cpu_linear, native

vnni = pytest.mark.skipif(not native.available() or not native.load().has_vnni(),
                          reason="the engine screens where int8 products run on AVX-512 VNNI")


def both(x: torch.Tensor, w: torch.Tensor) -> tuple[list[int], list[int]]:
    """(the screen's tokens, the argmax of every logit) for rows x through a head of weights w."""
    kernels = native.load()
    packed = kernels.pack_panels([w])
    every = kernels.argmax_rows(kernels.panel_linear(x, packed, w.shape[0], None))
    return kernels.screened_argmax_rows(x, packed, w.shape[0], *cpu_linear.head_screen(w)), every


def hidden(rows: int, width: int, g: torch.Generator) -> torch.Tensor:
    """Rows like a final norm's outputs: a few dimensions far larger than the others."""
    x = torch.randn(rows, width, generator=g)
    x[:, [3, width // 2]] *= 20
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 40])
def test_tokens_are_the_argmax_of_every_logit(rows, dtype):
    g = torch.Generator().manual_seed(rows)
    for _ in range(5):
        w = (torch.randn(1003, 96, generator=g) * 0.05).to(dtype)  # (a part panel at the end)
        x = hidden(rows, 96, g)
        got, want = both(x, w)
        assert got == want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_ties_go_to_the_first_feature(dtype):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(500, 64, generator=g)
    x = hidden(4, 64, g)
    w[400] = w[90] = x[0] * 2  # the largest logit of row 0, twice (and zeros in a feature of its own)
    w[7] = 0
    w = w.to(dtype)
    got, want = both(x, w)
    assert got == want and got[0] == 90
    assert both(torch.zeros(2, 64), w) == ([0, 0], [0, 0])  # every logit 0: the first


def test_near_ties_are_decided_by_the_fp32_logits():
    # two features a hair apart: their int8 copies are the same, their fp32 logits a few roundings apart or
    # equal; the screen must pick as the fp32 argmax does
    g = torch.Generator().manual_seed(1)
    winners = set()
    for _ in range(40):
        w = torch.randn(300, 64, generator=g) * 0.05
        x = hidden(1, 64, g)
        w[100] = x[0] / x[0].norm()
        w[250] = w[100] + torch.randn(64, generator=g) * 1e-8
        got, want = both(x, w)
        assert got == want
        winners.add(want[0])
    assert winners == {100, 250}  # (each of the two came out on top)


def test_rows_it_cannot_screen_take_every_logit():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(700, 64, generator=g)
    x = hidden(5, 64, g)
    x[0, 5] = float("nan")  # every logit NaN: the first NaN's index, 0
    x[1, 9] = float("inf")
    x[2] *= 1e36  # logits past fp32's range
    x[4, :32] *= 1e-38  # a block of subnormal inputs
    got, want = both(x, w)
    assert got == want and got[0] == 0
    flat = torch.full((700, 64), 0.1) + torch.randn(700, 64, generator=g) * 1e-7  # every feature a candidate
    got, want = both(x[3:], flat)
    assert got == want


def test_bad_screens_are_refused():
    kernels = native.load()
    w = torch.randn(100, 64)
    screen = cpu_linear.head_screen(w)
    packed = kernels.pack_panels([w])
    with pytest.raises(RuntimeError, match="head screen"):
        kernels.screened_argmax_rows(torch.randn(2, 64), packed, 100, w[:50].contiguous(), *screen[1:])
    with pytest.raises(RuntimeError, match="pack_panels"):
        kernels.screened_argmax_rows(torch.randn(2, 64), packed, 100, screen[0], screen[2], *screen[2:])  # not w8a8
    with pytest.raises(RuntimeError, match="fp32"):
        kernels.screened_argmax_rows(torch.randn(2, 64), cpu_linear.pack_int8([w]), 100, *screen)


@vnni
def test_the_decoder_screens_plain_heads_only():
    from jitney.kernels.cpu_layers import FusedLayers

    def decoder(model, **kw):
        with FusedLayers(model, **kw) as fused:
            return fused.decoder

    assert decoder(tiny_llama()).screened
    assert not decoder(tiny_llama(), quantized="int8").screened  # (its tokens are its int8 head's)
    assert not decoder(tiny_gemma2_capped()).screened  # soft-capped logits
    assert not decoder(tiny_granite()).screened  # divided logits
    broken = tiny_llama()
    with torch.no_grad():
        broken.lm_head.weight[5, 3] = float("nan")  # (its logit is NaN in every row: the plain head's argmax)
    assert not decoder(broken).screened


@vnni
async def test_engines_give_the_same_tokens_with_the_screen_and_without(monkeypatch):
    decoders = []
    real = cpu_layers.FusedDecoder.__init__
    monkeypatch.setattr(cpu_layers.FusedDecoder, "__init__", lambda self, *a, **kw: real(self, *a, **kw) or decoders.append(self))
    model = tiny_llama()
    work = random_requests(12, 256, max_prompt=40, max_new=16, seed=5)
    screened = await engine_tokens(model, work)
    plain = await engine_tokens(model, work, lm_head_screen=False)
    assert [d.screened for d in decoders] == [True, False]
    assert screened == plain == [reference(model, p, n) for p, n in work]
    for dtype in (torch.bfloat16, torch.float16):  # (computed in fp32 over their 16-bit weights, the head's too)
        half = tiny_llama().to(dtype)
        assert await engine_tokens(half, work) == await engine_tokens(half, work, lm_head_screen=False)
    rounded = await engine_tokens(model, work, weights="bf16")  # (the head's bf16 copy screened)
    assert rounded == await engine_tokens(model, work, weights="bf16", lm_head_screen=False)
    assert [d.screened for d in decoders[2:]] == [True, False] * 3


@vnni
def test_bench_measures_what_the_screen_gains(tmp_path):
    tiny_llama().save_pretrained(tmp_path / "tiny")
    out = tmp_path / "bench.json"
    assert cli(["bench", "--model", str(tmp_path / "tiny"), "--workload", "mixed-16", "--modes", "jitney,jitney-noscreen",
                "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["mode"] for r in rows] == ["jitney", "jitney-noscreen"] and rows[1]["same_tokens_as_first"] == 1.0


@vnni
async def test_flat_logits_take_every_logit_and_the_same_tokens(monkeypatch):
    # a head whose logits are all but equal: no row can be screened (more than 4,096 candidates), so each takes
    # every logit, and after 128 such rows the decoder leaves the screen alone for a while (16 steps, twice as
    # many after each window of rows that missed again): tokens unchanged
    decoders = []
    real = cpu_layers.FusedDecoder.__init__
    monkeypatch.setattr(cpu_layers.FusedDecoder, "__init__", lambda self, *a, **kw: real(self, *a, **kw) or decoders.append(self))

    model = flat_head_llama()
    work = random_requests(10, 8192, max_prompt=20, max_new=80, seed=6)
    assert await engine_tokens(model, work) == await engine_tokens(model, work, lm_head_screen=False)
    _, rest = decoders[0].native.screen_rest
    assert rest >= 64  # the screen tried again after its first rest (16 steps) and after its second (32)
