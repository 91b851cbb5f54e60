"""The C++ CPU kernels against torch (the paged decode kernel is covered with the attention backends)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from jitney.kernels import cpu_linear, native


def panel_linear(x, ws, b=None):
    kernels = native.load()
    return kernels.panel_linear(x, kernels.pack_panels(ws), sum(w.shape[0] for w in ws), b)


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 13])
@pytest.mark.parametrize("bias", [True, False])
def test_panel_linear_matches_f_linear(rows, bias):
    w, x = torch.randn(300, 70), torch.randn(rows, 70)  # 300 = 18 full panels of 16 and a part
    b = torch.randn(300) if bias else None
    torch.testing.assert_close(panel_linear(x, [w], b), F.linear(x, w, b), atol=1e-5, rtol=1e-5)


def test_panel_linear_rows_do_not_depend_on_the_rows_beside_them():
    # up to three rows go through panels in pairs, more through row tiles: every output sums in the same order
    kernels = native.load()
    w, b, x = torch.randn(300, 70), torch.randn(300), torch.randn(7, 70)
    packed = kernels.pack_panels([w])
    alone = torch.cat([kernels.panel_linear(x[i : i + 1].contiguous(), packed, 300, b) for i in range(7)])
    assert torch.equal(kernels.panel_linear(x, packed, 300, b), alone)
    for rows in (2, 3):
        blocks = [kernels.panel_linear(x[i : i + rows].contiguous(), packed, 300, b) for i in range(0, 7 - rows + 1, rows)]
        assert torch.equal(torch.cat(blocks), alone[: len(blocks) * rows])


def test_panel_linear_over_several_blocks_of_rows():
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(40, 2048, generator=g), torch.randn(70, 2048, generator=g)  # blocks of 30 rows stay in L2
    # sums of 2,048 products of about 45 each, taken in order: against the exact sums, not F.linear's rounding
    want = F.linear(x.double(), w.double()).float()
    torch.testing.assert_close(panel_linear(x, [w]), want, atol=2e-3, rtol=1e-4)


def test_packed_linears_match_nn_linear():
    layer = torch.nn.Linear(64, 96)
    with torch.inference_mode():
        for rows in (1, 2, 7):
            x = torch.randn(rows, 64)
            want = layer(x)
            with cpu_linear.PackedLinears(layer):
                got = layer(x)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


GATES = {"silu": F.silu, "gelu_tanh": lambda g: F.gelu(g, approximate="tanh")}


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 13, 300])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("activation", list(GATES))
def test_gated_panel_linear_is_the_activation_of_gate_times_up(rows, bias, activation):
    g = torch.Generator().manual_seed(rows)
    gate, up, x = torch.randn(96, 70, generator=g), torch.randn(96, 70, generator=g), torch.randn(rows, 70, generator=g)
    b = torch.randn(192, generator=g) if bias else None
    layer = cpu_linear.PanelLinear([gate, up], b, gated=True, activation=activation)
    both = F.linear(x, torch.cat([gate, up]), b)
    # (products of two sums of ~8 each: float rounding of either sum moves them by up to ~1e-5)
    torch.testing.assert_close(layer(x), GATES[activation](both[:, :96]) * both[:, 96:], atol=1e-4, rtol=1e-5)
    # the same arithmetic as the stacked linear and then `gated_act`
    kernels = native.load()
    code = cpu_linear.ACTIVATIONS[activation]
    assert torch.equal(layer(x), kernels.gated_act(cpu_linear.PanelLinear([gate, up], b)(x), code))


def test_unknown_activations_are_refused():
    with pytest.raises(ValueError, match="activation"):
        cpu_linear.PanelLinear([torch.randn(16, 8), torch.randn(16, 8)], None, gated=True, activation="relu")
    with pytest.raises(RuntimeError, match="activation"):
        native.load().gated_act(torch.randn(2, 8), 7)


def test_gated_packing_refuses_widths_that_are_not_whole_panels():
    kernels = native.load()
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kernels.pack_panels_gated(torch.randn(40, 8), torch.randn(40, 8))
    with pytest.raises(RuntimeError, match="gated weights"):
        kernels.panel_linear(torch.randn(1, 8), kernels.pack_panels([torch.randn(40, 8)]), 40, None, True)


def test_panel_linear_over_stacked_weight_blocks():
    ws, x, b = [torch.randn(100, 64), torch.randn(37, 64), torch.randn(70, 64)], torch.randn(3, 64), torch.randn(207)
    torch.testing.assert_close(panel_linear(x, ws, b), F.linear(x, torch.cat(ws), b), atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="one fp32 bias per output feature"):
        panel_linear(x, ws, torch.randn(100))


def test_panel_linear_refuses_other_dtypes_and_shapes():
    kernels = native.load()
    with pytest.raises(RuntimeError, match="fp32 weights"):
        kernels.pack_panels([torch.randn(4, 8, dtype=torch.float64)])
    with pytest.raises(RuntimeError, match=r"fp32 weights \(or all bf16, or all fp16\)"):
        kernels.pack_panels([torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(4, 8)])
    packed = kernels.pack_panels([torch.randn(4, 8)])
    with pytest.raises(RuntimeError, match="contiguous fp32"):
        kernels.panel_linear(torch.randn(1, 8, dtype=torch.float64), packed, 4, None)
    with pytest.raises(RuntimeError, match="contiguous fp32"):
        kernels.panel_linear(torch.randn(1, 9), packed, 4, None)


def test_panel_linear_from_two_threads_at_once():
    """The kernels' own thread pool takes one caller at a time; a second one meanwhile computes alone."""
    from concurrent.futures import ThreadPoolExecutor

    kernels = native.load()
    w = torch.randn(4096, 256)
    packed = kernels.pack_panels([w])
    xs = [torch.randn(2, 256) for _ in range(2)]
    want = [F.linear(x, w) for x in xs]

    def run(i):
        return all(torch.allclose(kernels.panel_linear(xs[i], packed, 4096, None), want[i], atol=1e-4, rtol=1e-4)
                   for _ in range(200))

    with ThreadPoolExecutor(2) as pool:
        assert all(pool.map(run, [0, 1]))


def test_kernels_work_in_a_forked_child():
    """The pool's workers do not survive a fork; the child makes a pool of its own instead of waiting on them."""
    import multiprocessing

    w, x = torch.randn(512, 64), torch.randn(2, 64)
    panel_linear(x, [w])  # the parent's pool exists now (two rows run on it)
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1) as pool:
        got = pool.apply_async(panel_linear, (x, [w])).get(timeout=60)
    torch.testing.assert_close(got, F.linear(x, w), atol=1e-5, rtol=1e-5)


def test_packed_linears_fall_back_to_onednn_without_the_kernels(monkeypatch):
    layer = torch.nn.Linear(64, 96)
    monkeypatch.setattr(native, "available", lambda: False)
    with torch.inference_mode():
        x = torch.randn(5, 64)
        want = layer(x)
        with cpu_linear.PackedLinears(layer):
            assert not isinstance(layer.forward, cpu_linear.PanelLinear)
            got = layer(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_packed_weights_outlive_the_others_of_their_chunk():
    """Packs share 2 MiB-aligned chunks (huge pages); each keeps its chunk alive until the last one goes."""
    kernels = native.load()
    ws = [torch.randn(96, 64) for _ in range(3)]
    packs = [kernels.pack_panels([w]) for w in ws]
    del packs[0], packs[0]  # the first two
    x = torch.randn(3, 64)
    torch.testing.assert_close(kernels.panel_linear(x, packs[0], 96, None), F.linear(x, ws[2]), atol=1e-5, rtol=1e-5)
    big = kernels.pack_panels([torch.randn(40 << 20 >> 8, 64)])  # 40 MiB: a chunk of its own, larger than 32 MiB
    assert big.data_ptr() % (2 << 20) == 0
