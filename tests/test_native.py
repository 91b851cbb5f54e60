"""The C++ CPU kernels against torch (the paged decode kernel is covered with the attention backends)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from jitney.kernels import cpu_linear, native


@pytest.mark.parametrize("rows", [1, 2, 5])
@pytest.mark.parametrize("bias", [True, False])
def test_small_linear_matches_f_linear(rows, bias):
    w, x = torch.randn(300, 70), torch.randn(rows, 70)
    b = torch.randn(300) if bias else None
    torch.testing.assert_close(native.load().small_linear(x, [w], b), F.linear(x, w, b), atol=1e-5, rtol=1e-5)


def test_packed_linears_match_nn_linear_on_the_small_path_and_on_onednn():
    layer = torch.nn.Linear(64, 96)
    with torch.inference_mode():
        for rows in (1, cpu_linear.SMALL_ROWS, cpu_linear.SMALL_ROWS + 3):
            x = torch.randn(rows, 64)
            want = layer(x)
            with cpu_linear.PackedLinears(layer):
                got = layer(x)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_small_linear_over_stacked_weight_blocks():
    ws, x, b = [torch.randn(100, 64), torch.randn(37, 64), torch.randn(70, 64)], torch.randn(2, 64), torch.randn(207)
    torch.testing.assert_close(native.load().small_linear(x, ws, b), F.linear(x, torch.cat(ws), b), atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="one bias per output feature"):
        native.load().small_linear(x, ws, torch.randn(100))


def test_small_linear_refuses_other_dtypes():
    with pytest.raises(RuntimeError, match="contiguous fp32"):
        native.load().small_linear(torch.randn(1, 8, dtype=torch.float64), [torch.randn(4, 8, dtype=torch.float64)], None)


def test_small_linear_from_two_threads_at_once():
    """The kernels' own thread pool takes one caller at a time; a second one meanwhile computes alone."""
    from concurrent.futures import ThreadPoolExecutor

    kernel = native.load().small_linear
    w = torch.randn(4096, 256)
    xs = [torch.randn(2, 256) for _ in range(2)]
    want = [F.linear(x, w) for x in xs]

    def run(i):
        return all(torch.allclose(kernel(xs[i], [w], None), want[i], atol=1e-4, rtol=1e-4) for _ in range(200))

    with ThreadPoolExecutor(2) as pool:
        assert all(pool.map(run, [0, 1]))


def test_kernels_work_in_a_forked_child():
    """The pool's workers do not survive a fork; the child makes a pool of its own instead of waiting on them."""
    import multiprocessing

    kernel = native.load().small_linear
    w, x = torch.randn(512, 64), torch.randn(2, 64)
    kernel(x, [w], None)  # the parent's pool exists now
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1) as pool:
        got = pool.apply_async(_small_linear_in_child, (x, w)).get(timeout=60)
    torch.testing.assert_close(got, F.linear(x, w), atol=1e-5, rtol=1e-5)


def _small_linear_in_child(x, w):
    return native.load().small_linear(x, [w], None)
