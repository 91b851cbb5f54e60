"""bf16 compute (`EngineConfig(compute="bf16")`): each linear's rows and weights rounded to bfloat16, products
summed in fp32 on whichever unit the CPU offers (AMX tiles, AVX512-BF16, plain C++; every unit it offers is
tested, the plain one on every CPU). A row's outputs are the exact sums of the rounded products to float rounding,
alone or in any batch bit for bit; the engine's tokens are those of torch's reference of the same rounding, and
the configuration is refused where it cannot run."""

from __future__ import annotations

import copy
import functools
import logging

import pytest
import torch
import torch.nn.functional as F
import transformers as T
from support import engine_tokens, random_requests, reference, scaled_tiny

from jitney import Engine, EngineConfig
from jitney.kernels import cpu_linear, native

pytestmark = pytest.mark.skipif(not native.available(), reason="bf16 compute needs jitney's C++ kernels")

UNITS = ["portable", "avx512-bf16", "amx"]


@functools.cache
def best() -> str:
    """The best unit this CPU (and its OS) offers: the one the kernels chose as they loaded (a test that sets another
    sets it back after it)."""
    return native.load().bf16_unit()


def offered() -> list[str]:
    """The units this CPU (and its OS) offers: the best one and every lesser one, and AMX's code on emulated tiles
    (offered on every CPU)."""
    return UNITS[: UNITS.index(best()) + 1] + ["amx-emulated"]


@pytest.fixture
def unit():
    """Sets a unit for the test (`use(name)`), and the best one back after it."""
    kernels = native.load()
    best = kernels.bf16_unit()
    yield kernels.bf16_unit
    kernels.bf16_unit(best)


def exact(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T + b over x and w rounded to bf16, in float64 (the products and their sums exact to ~1e-16)."""
    y = x.to(torch.bfloat16).double() @ w.to(torch.bfloat16).double().T
    return (y if b is None else y + b.double()).float()


SHAPES = [(1, 64, 48), (5, 96, 32), (16, 32, 16), (17, 128, 80), (33, 64, 200), (70, 96, 33)]
"""(rows, inputs, outputs): one row to past two tiles of 32, one panel to many and a part of one."""


@pytest.mark.parametrize("rows, k, n", SHAPES)
def test_each_unit_sums_the_rounded_products(unit, rows, k, n):
    g = torch.Generator().manual_seed(rows + k + n)
    x, w, b = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    for bias in (b, None):
        layer = cpu_linear.PanelLinear([w], bias, compute="bf16")
        assert layer.compute == "bf16" and layer.packed.dim() == 4
        want = exact(x, w, bias)
        for name in offered():
            unit(name)
            # sums of up to 128 products of about 1 each, in fp32: a few ulps of ~10
            torch.testing.assert_close(layer(x), want, atol=1e-4, rtol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_each_unit_computes_the_gated_mlp(unit, activation):
    g = torch.Generator().manual_seed(1)
    gate, up, x = torch.randn(48, 64, generator=g), torch.randn(48, 64, generator=g), torch.randn(37, 64, generator=g)
    b = torch.randn(96, generator=g)
    layer = cpu_linear.PanelLinear([gate, up], b, gated=True, activation=activation, compute="bf16")
    act = F.silu if activation == "silu" else lambda t: F.gelu(t, approximate="tanh")
    want = act(exact(x, gate, b[:48]).double()) * exact(x, up, b[48:]).double()
    for name in offered():
        unit(name)
        torch.testing.assert_close(layer(x), want.float(), atol=1e-3, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def tile_order(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """x @ w.T + b over x and w rounded to bf16, summed in fp32 as AMX's `tdpbf16ps` sums them by Intel's reference:
    a step of 32 inputs at a time, within a step the products of even and of odd inputs summed apart, then the two
    added, and that added to the sums so far (each product exact in fp32; each addition rounded)."""
    x, w = x.to(torch.bfloat16).float(), w.to(torch.bfloat16).float()
    y = torch.zeros(x.shape[0], w.shape[0])
    for step in range(0, x.shape[1], 32):
        even, odd = torch.zeros_like(y), torch.zeros_like(y)
        for i in range(step, step + 32, 2):
            even = even + x[:, i : i + 1] * w[:, i]
            odd = odd + x[:, i + 1 : i + 2] * w[:, i + 1]
        y = y + (even + odd)
    return y + b


@pytest.mark.parametrize("rows, k, n", SHAPES)
def test_amx_code_sums_in_the_tiles_order_on_emulated_tiles(unit, rows, k, n):
    """AMX's own code (its layout, strides, tile shapes, one or two tiles of rows and of panels) on tiles emulated
    in plain C++, where every CPU runs it: the emulation sums as the instruction's reference says, so each output is
    that order's sum bit for bit, and a slip of a stride or a tile would show as a sum of the wrong products."""
    g = torch.Generator().manual_seed(rows * k + n)
    x, w, b = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    layer = cpu_linear.PanelLinear([w], b, compute="bf16")
    assert unit("amx-emulated") == "amx-emulated"
    assert torch.equal(layer(x), tile_order(x, w, b))


def test_a_row_gives_the_same_bits_alone_and_in_any_batch(unit):
    g = torch.Generator().manual_seed(2)
    w, b, x = torch.randn(200, 96, generator=g), torch.randn(200, generator=g), torch.randn(70, 96, generator=g)
    layer = cpu_linear.PanelLinear([w], b, compute="bf16")
    for name in offered():
        unit(name)
        alone = torch.cat([layer(x[i : i + 1]) for i in range(70)])
        assert torch.equal(layer(x), alone), name
        for rows in (2, 16, 31, 33):  # batches ending inside and past a tile of 16 or 32 rows
            assert torch.equal(layer(x[:rows]), alone[:rows]), (name, rows)


def test_the_best_unit_is_what_the_cpu_reports(unit):
    """Linux lists the instruction sets the CPU has and the kernel enables (`/proc/cpuinfo`'s flags): where it lists
    AVX512-BF16, plain C++ would be a detection gone wrong."""
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        pytest.skip("no /proc/cpuinfo flags to compare with")
    if "avx512_bf16" in flags or "amx_bf16" in flags:
        assert best() in ("avx512-bf16", "amx")
    if "amx_bf16" not in flags:
        assert best() != "amx" and native.load().bf16_why_not_amx() == "the CPU has no AMX-BF16"
    else:  # (AMX, or why not: refused by the OS)
        assert (best() == "amx") == (native.load().bf16_why_not_amx() == ""), native.load().bf16_why_not_amx()
    if "avx512_bf16" not in flags and "amx_bf16" not in flags:
        assert best() == "portable"


def test_units_refuse_what_the_cpu_does_not_offer(unit):
    with pytest.raises(RuntimeError, match="one of portable, avx512-bf16, amx, amx-emulated"):
        unit("avx512")
    chosen = best()
    for name in UNITS[UNITS.index(chosen) + 1 :]:
        with pytest.raises(RuntimeError, match=f"offers {chosen} at best"):
            unit(name)
    assert unit("portable") == "portable" and unit("amx-emulated") == "amx-emulated"


def test_narrow_inputs_keep_fp32_rows_over_bf16_weights():
    w, x = torch.randn(40, 48), torch.randn(3, 48)  # 48 inputs: not whole steps of 32
    layer = cpu_linear.PanelLinear([w], None, compute="bf16")
    assert layer.compute == "fp32"
    assert torch.equal(layer(x), cpu_linear.PanelLinear([w], None, quantized="bf16")(x))
    with pytest.raises(ValueError, match="not int8"):
        cpu_linear.PanelLinear([w], None, quantized="int8", compute="bf16")
    with pytest.raises(ValueError, match="compute"):
        cpu_linear.PanelLinear([w], None, compute="fp16")


MODELS = {
    "llama": lambda: scaled_tiny(T.LlamaConfig, T.LlamaForCausalLM, num_key_value_heads=2),  # the one-call decoder
    "qwen2 biases": lambda: scaled_tiny(T.Qwen2Config, T.Qwen2ForCausalLM, num_key_value_heads=2, vary_vectors=True),
    "phi3": lambda: scaled_tiny(T.Phi3Config, T.Phi3ForCausalLM, num_key_value_heads=2),  # packed linears, torch layers
}


@pytest.mark.parametrize("name", list(MODELS))
async def test_tokens_are_those_of_torchs_reference_of_the_rounding(name, unit):
    model = MODELS[name]()
    work = random_requests(8, model.config.vocab_size, max_prompt=40, max_new=20, seed=3)
    fp32 = [reference(model, p, n) for p, n in work]
    with cpu_linear.QuantizedReference(model, None, compute="bf16"):
        rounded = [reference(model, p, n) for p, n in work]
    assert rounded != fp32, "the workload should tell bf16 compute from fp32"
    for each in offered():
        unit(each)
        assert await engine_tokens(model, work, compute="bf16", speculative_tokens=0) == rounded, each
    assert [reference(model, p, n) for p, n in work] == fp32  # the model's own weights untouched


async def test_chunking_and_batching_leave_the_tokens_alone():
    model = MODELS["llama"]()
    work = random_requests(6, model.config.vocab_size, max_prompt=40, max_new=16, seed=5)
    together = await engine_tokens(model, work, compute="bf16")
    assert [(await engine_tokens(model, [w], compute="bf16"))[0] for w in work] == together
    assert await engine_tokens(model, work, compute="bf16", max_batch_tokens=5) == together


async def test_a_bf16_model_computes_on_the_one_call_decoder_as_its_fp32_copy_would(caplog):
    model = MODELS["llama"]().to(torch.bfloat16)
    widened = copy.deepcopy(model).float()  # the same weights: bf16 compute rounds nothing more of them
    work = random_requests(8, model.config.vocab_size, max_prompt=40, max_new=20, seed=3)
    with cpu_linear.QuantizedReference(widened, None, compute="bf16"):
        rounded = [reference(widened, p, n) for p, n in work]
    with caplog.at_level(logging.INFO, logger="jitney"):
        async with Engine(model, config=EngineConfig(compute="bf16", num_blocks=64)) as engine:
            assert engine.executor.decoder is not None
    unit, why = native.load().bf16_unit(), native.load().bf16_why_not_amx()
    assert f"linear layers compute in bf16 on {unit}" in caplog.text  # (which unit runs, and why not AMX)
    assert (f"not AMX: {why}" in caplog.text) == (unit != "amx"), caplog.text
    assert await engine_tokens(model, work, compute="bf16", speculative_tokens=0) == rounded


async def test_a_bf16_model_computes_in_bf16_by_default_where_the_cpu_has_a_matrix_unit(unit):
    model = MODELS["llama"]().to(torch.bfloat16)
    work = random_requests(8, model.config.vocab_size, max_prompt=40, max_new=20, seed=3)
    bf16 = await engine_tokens(model, work, compute="bf16", speculative_tokens=0)
    assert bf16 != await engine_tokens(model, work, compute="fp32", speculative_tokens=0)  # (the rows' rounding shows)
    for each in offered():
        unit(each)
        default = "bf16" if each in ("amx", "avx512-bf16") else "fp32"  # (plain C++ would be slower than fp32)
        assert Engine(model, config=EngineConfig(num_blocks=64)).config.compute == default, each
    unit(best())
    assert await engine_tokens(model, work, speculative_tokens=0) == bf16
    # not where the rows would lose more than the model's own precision, or where the decoder does not serve
    for other, fields in ((MODELS["llama"](), {}), (MODELS["llama"]().to(torch.float16), {}),
                          (model, {"fuse_cpu_layers": False}), (model, {"batch_invariant": True})):
        assert Engine(other, config=EngineConfig(num_blocks=64, **fields)).config.compute == "fp32"


async def test_bf16_compute_is_refused_where_it_cannot_run():
    model = MODELS["llama"]()
    with pytest.raises(ValueError, match="pack_cpu_weights=False"):
        async with Engine(model, config=EngineConfig(compute="bf16", pack_cpu_weights=False)):
            pass
    with pytest.raises(ValueError, match="not weights='int8'"):
        async with Engine(model, config=EngineConfig(compute="bf16", weights="int8")):
            pass
    with pytest.raises(ValueError, match="compute"):
        EngineConfig(compute="fp16")


def test_quality_scores_bf16_compute(tmp_path):
    import json

    from jitney.cli import main as cli

    out = tmp_path / "quality.json"
    assert cli(["quality", "--weights", "fp32,bf16c", "--tokens", "200", "--window", "100", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["weights"] for r in rows] == ["fp32", "bf16c"]
    assert rows[1]["perplexity"] != rows[0]["perplexity"]  # (it computes in bf16: the scores move, a little)
    assert abs(rows[1]["perplexity_vs_first"]) < 0.02 and rows[1]["top1_same_as_first"] > 0.9


def test_the_linears_bench_names_the_unit_and_times_each_shape(capsys):
    from jitney.bench import linears

    assert linears.main(["--shapes", "64x32g,64x48", "--rows", "1,3"]) == 0
    out = capsys.readouterr().out
    assert f"bf16 compute on {native.load().bf16_unit()}" in out
    assert len([line for line in out.splitlines() if line.lstrip().startswith(("64x32g", "64x48"))]) == 4
