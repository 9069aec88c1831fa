"""The bias gradient taken inside the filter gradient's loops
(``conv3d_backward_filter_bias``) is dy's per-filter sum, and leaves the filter gradient's
bits alone, on every kernel path."""

from __future__ import annotations

import numpy as np
import pytest

from cosmotrain.kernels.cpu import workers as _parallel
from cosmotrain.kernels.compiled import choice as compiled_choice, direct
from cosmotrain.kernels import conv3d
from cosmotrain.kernels.geometry import ConvGeometry

# (input shape, filters, compiled loops on): the kernel each reaches with the AVX-512
# loops (checked there; elsewhere the same cases run whatever kernel they reach).
PATHS = {
    "winograd-f4": ((1, 16, 4, 8, 40), 16, True),
    "winograd-f2": ((2, 16, 4, 24, 12), 20, True),
    "direct": ((2, 4, 5, 4, 60), 12, True),  # 60 outputs a row: zero-padded dy rows
    "lowered": ((2, 6, 5, 7, 9), 5, False),
}


def _case(shape, filters, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    geo = ConvGeometry.create(shape, (filters, shape[1], 3, 3, 3), 1, 1)
    dy = (rng.standard_normal(geo.y_shape) + 0.5).astype(np.float32)  # a sum far from 0
    return x, dy, geo


@pytest.mark.parametrize("path", list(PATHS))
def test_bias_gradient_from_the_filter_gradient_loops(path, monkeypatch) -> None:
    shape, filters, loops = PATHS[path]
    monkeypatch.setattr(compiled_choice, "USE_DIRECT", loops)
    _parallel.set_num_workers(2)
    try:
        x, dy, geo = _case(shape, filters)
        if loops and direct.instruction_set() == "avx512":
            kernel = compiled_choice.filter_grad_kernel(geo, np.float32)
            assert kernel == path.split("-")[0], (path, kernel)
            if kernel == "winograd":
                assert compiled_choice.winograd_tile(geo) == int(path[-1])
        dw, db = conv3d.conv3d_backward_filter_bias(x, dy, geo.w_shape, 1, 1)
        alone = conv3d.conv3d_backward_filter(x, dy, geo.w_shape, 1, 1)
    finally:
        _parallel.set_num_workers(None)
    np.testing.assert_array_equal(dw, alone)
    assert db.dtype == np.float32 and db.shape == (filters,)
    exact = dy.astype(np.float64).sum(axis=(0, 2, 3, 4))
    np.testing.assert_allclose(db, exact, rtol=2e-6, atol=1e-6 * np.abs(dy).sum())


def test_bias_gradient_of_no_sample_and_of_float64() -> None:
    x, dy, geo = _case((2, 3, 4, 5, 6), 4)
    dw, db = conv3d.conv3d_backward_filter_bias(x[:0], dy[:0], geo.w_shape, 1, 1)
    assert not dw.any() and not db.any() and db.shape == (4,)
    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    dw, db = conv3d.conv3d_backward_filter_bias(x64, dy64, geo.w_shape, 1, 1)
    assert db.dtype == np.float64
    np.testing.assert_array_equal(dw, conv3d.conv3d_backward_filter(x64, dy64, geo.w_shape,
                                                                    1, 1))
    np.testing.assert_allclose(db, dy64.sum(axis=(0, 2, 3, 4)), rtol=1e-12)
