"""The compiled direct convolution loops (cosmotrain/kernels/compiled/direct.py) against references.

Each case runs the AVX-512 and the AVX2 loops (whichever this CPU runs) in float32 and
compares them with the direct-loop float64 reference of test_conv3d: odd widths (partial
register runs), filter counts that leave a register block part-empty, kernel widths of
1 to 5 (the filter gradient's taps in blocks of 3), asymmetric padding, bias, several
chunks and workers.  The data gradient runs through ``conv3d_backward_data`` with the
dispatch opened to small shapes.  A build check makes a missing library fail where a C
compiler and an AVX2 CPU are present, instead of silently skipping everything.
"""

from __future__ import annotations

import platform
import shutil

import numpy as np
import pytest

from cosmotrain.kernels.cpu import workers as _parallel
from cosmotrain.kernels.compiled import choice as compiled_choice, direct, winograd
from cosmotrain.kernels import conv3d as conv
from cosmotrain.kernels.geometry import ConvGeometry
from test_conv3d import reference_conv3d

ISAS = [isa for isa in ("avx512", "avx2") if direct.loops_for(isa) is not None]

# N, C, F, spatial (D, H, W), kernel, padding
CASES = [
    (2, 4, 16, (9, 10, 21), 3, 1),
    (1, 3, 5, (6, 7, 33), 3, ((1, 0), (0, 2), (2, 1))),
    (1, 16, 9, (5, 6, 40), 3, 1),
    (2, 2, 13, (5, 5, 17), (2, 3, 4), ((0, 1), (1, 1), (2, 1))),
    (1, 3, 4, (4, 6, 9), (3, 2, 5), ((1, 1), (0, 1), (2, 2))),
    (1, 5, 3, (6, 4, 7), (2, 2, 1), 0),
    (1, 1, 8, (3, 3, 1), 1, 0),
    (1, 2, 8, (3, 40, 40), 3, 1),  # filter gradient: rows in several tiles
]
IDS = [f"case{i}" for i in range(len(CASES))]


def _cpu_has_avx2() -> bool:
    try:
        with open("/proc/cpuinfo") as info:
            flags = info.read()
    except OSError:
        return False
    return " avx2" in flags and " fma" in flags


def test_library_is_built_where_it_can_be() -> None:
    """On x86-64 Linux with a C compiler and AVX2 the install builds and loads the loops."""
    if platform.machine() != "x86_64" or shutil.which("cc") is None or not _cpu_has_avx2():
        pytest.skip("no C compiler or no AVX2 CPU: the numpy kernels run instead")
    assert direct.available(), "pip install did not build cosmotrain.kernels.compiled._directconv"
    assert direct.instruction_set() in ("avx512", "avx2")


@pytest.fixture(params=ISAS or [pytest.param(None, marks=pytest.mark.skip("no direct loops"))])
def isa(request, monkeypatch):
    """Run with the loops of one instruction set, 2 workers and two planes per chunk."""
    monkeypatch.setattr(direct, "active_loops", lambda: direct.loops_for(request.param))
    monkeypatch.setattr(direct, "CHUNK_PLANES", 2)
    _parallel.set_num_workers(2)
    yield request.param
    _parallel.set_num_workers(None)


def _data(case, seed=0):
    n, c, f, spatial, k, pad = case
    k = (k,) * 3 if isinstance(k, int) else k
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c) + spatial)
    w = rng.standard_normal((f, c) + k)
    geo = ConvGeometry.create(x.shape, w.shape, 1, pad)
    return x, w, pad, geo


def _close(ours: np.ndarray, exact: np.ndarray) -> None:
    assert ours.dtype == np.float32
    np.testing.assert_allclose(ours, exact, rtol=1e-4, atol=2e-6 * np.abs(exact).max())


def check_forward(module, case, *options) -> None:
    """``module.forward`` (direct or Winograd) with a bias against the float64 reference."""
    x, w, pad, geo = _data(case)
    bias = np.random.default_rng(3).standard_normal(geo.filters)
    expected = reference_conv3d(x, w, 1, pad) + bias.reshape(1, -1, 1, 1, 1)
    y = np.full(geo.y_shape, np.nan, np.float32)
    module.forward(x.astype(np.float32), w.astype(np.float32), geo, y, bias.astype(np.float32),
                   *options)
    _close(y, expected)


def check_filter_gradient(module, case, *tile) -> None:
    """``module.filter_grad`` against the float64 numpy kernel, and the dot test against
    the float64 reference forward."""
    x, w, pad, geo = _data(case)
    r = np.random.default_rng(1).standard_normal(geo.y_shape)
    exact = conv.conv3d_backward_filter(x, r, w.shape, 1, pad)  # float64 numpy kernels
    ours = module.filter_grad(x.astype(np.float32), r.astype(np.float32), geo, *tile)
    assert ours.shape == w.shape
    _close(ours, exact)
    assert np.vdot(reference_conv3d(x, w, 1, pad), r) == pytest.approx(
        np.vdot(w, ours.astype(np.float64)), rel=1e-4)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_forward(case, isa) -> None:
    check_forward(direct, case)


@pytest.mark.parametrize("width", [64, 60])
@pytest.mark.parametrize("slope", [None, 0.01])
@pytest.mark.parametrize("aligned", [True, False])
def test_streamed_outputs_are_the_plain_stores_bit_for_bit(width, slope, aligned, isa,
                                                            monkeypatch) -> None:
    """Outputs past ``STREAM_BYTES`` bypass the caches (AVX-512), LeakyReLU applied in
    registers: the same bits as plain stores, for whole runs and a last partial one (60),
    and for an output not aligned to a vector (plain stores then)."""
    x, w, pad, geo = _data((2, 3, 5, (3, 4, width), 3, 1))
    x, w = x.astype(np.float32), w.astype(np.float32)
    bias = np.random.default_rng(3).standard_normal(geo.filters).astype(np.float32)
    size = int(np.prod(geo.y_shape))
    results = []
    for threshold in (1 << 62, 0):
        monkeypatch.setattr(direct, "STREAM_BYTES", threshold)
        block = np.full(size + 16, np.nan, np.float32)
        start = (-block.ctypes.data // 4) % 16 + (0 if aligned else 1)
        y = block[start:start + size].reshape(geo.y_shape)
        direct.forward(x, w, geo, y, bias, slope=slope)
        results.append(y.copy())
    assert (results[0] < 0).any() and not np.isnan(results[0]).any()
    np.testing.assert_array_equal(results[1], results[0])


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_filter_gradient(case, isa) -> None:
    check_filter_gradient(direct, case)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_data_gradient_through_the_dispatch(case, isa, monkeypatch) -> None:
    """conv3d_backward_data takes the loops (flipped, transposed kernel) once the
    width rule is opened to small shapes; checked by a dot test against the reference."""
    monkeypatch.setattr(compiled_choice, "MAX_DIRECT_WASTE", 1e9)
    monkeypatch.setattr(direct, "register_run", lambda: 1)
    monkeypatch.setattr(direct, "filter_block", lambda: 1)
    x, w, pad, geo = _data(case)
    if any(lo >= k or hi >= k for (lo, hi), k in zip(geo.padding, geo.kernel)):
        pytest.skip("padding >= kernel scatters")
    check_data_gradient(direct, case, monkeypatch)


def check_data_gradient(module, case, monkeypatch) -> None:
    """conv3d_backward_data in float32 calls ``module.forward`` once (the flipped kernel's
    forward); its result against the float64 numpy kernels and a dot test against the
    reference forward."""
    calls = []
    monkeypatch.setattr(module, "forward", _recording(module.forward, calls))
    x, w, pad, geo = _data(case)
    r = np.random.default_rng(1).standard_normal(geo.y_shape)
    exact = conv.conv3d_backward_data(r, w, x.shape, 1, pad)  # float64: numpy kernels
    ours = conv.conv3d_backward_data(r.astype(np.float32), w.astype(np.float32), x.shape,
                                     1, pad)
    assert len(calls) == 1
    _close(ours, exact)
    # relative to the sum of the terms' sizes as well: with F(4,3)'s rounding a dot of
    # nearly cancelling terms (-5.97 from terms of 2.9e4 in all) moved by 1.2e-4
    scale = np.vdot(np.abs(x), np.abs(ours.astype(np.float64)))
    assert np.vdot(reference_conv3d(x, w, 1, pad), r) == pytest.approx(
        np.vdot(x, ours.astype(np.float64)), rel=1e-4, abs=1e-6 * scale)


# N, C, F, spatial, padding (kernel 3 wide): odd output widths (the last tile's second
# output dropped), one-tile rows, asymmetric W padding, kernels of depth / height 1 or 2
WINOGRAD_CASES = [
    (2, 4, 16, (9, 10, 21), 3, 1),
    (1, 3, 5, (6, 7, 33), 3, ((1, 0), (0, 2), (2, 1))),
    (1, 9, 13, (5, 6, 2), 3, ((0, 1), (1, 1), (1, 1))),
    (1, 2, 9, (4, 5, 12), (2, 1, 3), ((1, 0), (0, 0), (0, 2))),
    (2, 6, 8, (3, 40, 40), 3, 1),  # planes of several register runs
    (2, 5, 9, (10, 4, 6), 3, 1),   # small planes: a filter gradient sums several z at once
    (1, 70, 9, (3, 4, 10), (2, 3, 3), 1),  # 70 channels: blocks of 32, 32 and 6 (forward)
    (1, 4, 8, (5, 6, 34), 3, ((1, 1), (1, 0), (0, 0))),  # rows read in place (no W padding)
    (1, 3, 8, (4, 5, 70), 3, ((0, 2), (2, 0), (1, 1))),  # rows of >= 16 tiles, in padding
]
WINOGRAD_IDS = [f"case{i}" for i in range(len(WINOGRAD_CASES))]


@pytest.mark.parametrize("tile", [2, 4])
@pytest.mark.parametrize("case", WINOGRAD_CASES, ids=WINOGRAD_IDS)
def test_winograd_forward(case, isa, tile) -> None:
    """F(2,3) and F(4,3): odd widths leave a last tile part-used."""
    check_forward(winograd, case, tile)


@pytest.mark.parametrize("tile", [2, 4])
def test_winograd_reads_strided_inputs_in_place(isa, tile) -> None:
    """The loops read a chunk's input window where it lies, through the sample's strides
    (a spatial layer's extended block is a view of its halo buffer): the bits of a
    contiguous copy, forward and filter gradient."""
    rng = np.random.default_rng(7)
    big = rng.standard_normal((2, 5, 8, 9, 44)).astype(np.float32)
    x = big[:, 1:4, 1:7, 2:8, 3:39]  # (2, 3, 6, 6, 36): rows contiguous, planes strided
    w = rng.standard_normal((8, 3, 3, 3, 3)).astype(np.float32)
    pad = ((1, 0), (0, 1), (1, 1))
    geo = ConvGeometry.create(x.shape, w.shape, 1, pad)
    dy = rng.standard_normal(geo.y_shape).astype(np.float32)
    dense = np.ascontiguousarray(x)
    for call in (lambda a: winograd.forward(a, w, geo, np.empty(geo.y_shape, np.float32),
                                            None, tile),
                 lambda a: winograd.filter_grad(a, dy, geo, tile)):
        np.testing.assert_array_equal(call(x), call(dense))


@pytest.mark.parametrize("tile", [2, 4])
@pytest.mark.parametrize("case", WINOGRAD_CASES, ids=WINOGRAD_IDS)
def test_winograd_filter_gradient(case, isa, tile) -> None:
    """F(2,3) and F(4,3): the dy components of a last tile past the row are zeros."""
    check_filter_gradient(winograd, case, tile)


@pytest.mark.parametrize("case", WINOGRAD_CASES, ids=WINOGRAD_IDS)
@pytest.mark.parametrize("tile_width", [1, 1 << 20], ids=["F(4,3)", "F(2,3)"])
def test_winograd_data_gradient_through_the_dispatch(case, isa, monkeypatch,
                                                     tile_width) -> None:
    monkeypatch.setattr(compiled_choice, "WINOGRAD_MIN_CHANNELS", 1)
    monkeypatch.setattr(compiled_choice, "WINOGRAD_MIN_RUNS", 0)
    monkeypatch.setattr(compiled_choice, "WINOGRAD4_MIN_WIDTH", tile_width)
    check_data_gradient(winograd, case, monkeypatch)


def _recording(fn, calls):
    def wrapped(*args, **kwargs):
        calls.append(args[2])
        return fn(*args, **kwargs)
    return wrapped


def test_results_do_not_depend_on_chunks_or_workers(monkeypatch) -> None:
    """Each output's sum runs in one fixed order: bit-identical across chunkings."""
    if not direct.available():
        pytest.skip("no direct loops")
    x, w, pad, geo = _data((2, 4, 16, (9, 10, 64), 3, 1))
    x32, w32 = x.astype(np.float32), w.astype(np.float32)
    runs = []
    for planes, workers in [(1, 2), (4, 1), (100, 2)]:
        monkeypatch.setattr(direct, "CHUNK_PLANES", planes)
        _parallel.set_num_workers(workers)
        try:
            runs.append(direct.forward(x32, w32, geo, np.empty(geo.y_shape, np.float32)))
        finally:
            _parallel.set_num_workers(None)
    assert all(np.array_equal(runs[0], run) for run in runs[1:])


@pytest.mark.parametrize("tile", [2, 4])
def test_winograd_filter_groups_are_the_plane_chunks_bit_for_bit(monkeypatch, tile) -> None:
    """A small sample split among workers by filter blocks (27 filters: groups of whole
    blocks and a short last one, with a bias) gives the plane chunks' results exactly."""
    if not direct.available():
        pytest.skip("no direct loops")
    x, w, pad, geo = _data((2, 6, 27, (4, 5, 8), 3, 1))
    x32, w32 = x.astype(np.float32), w.astype(np.float32)
    bias = np.random.default_rng(3).normal(size=27).astype(np.float32)
    runs = []
    for split_runs, workers in [(0, 1), (0, 3), (100, 3), (100, 2)]:
        monkeypatch.setattr(winograd, "FILTER_SPLIT_RUNS", split_runs)
        _parallel.set_num_workers(workers)
        try:
            loops = direct.active_loops()
            groups = winograd._filter_groups(geo, geo.out[1] * -(-geo.out[2] // tile), loops)
            assert len(groups) == (min(workers, 4) if split_runs else 1)
            runs.append(winograd.forward(x32, w32, geo, np.empty(geo.y_shape, np.float32),
                                         bias, tile))
        finally:
            _parallel.set_num_workers(None)
    assert all(np.array_equal(runs[0], run) for run in runs[1:])
    _close(runs[0] - bias[:, None, None, None], conv.conv3d_forward(x, w, 1, pad))


def test_dispatch_rule() -> None:
    """float32 unit-stride layers with wide rows take the loops; float64, strided or
    narrow ones keep the lowerings; wide layers with large planes take Winograd."""
    if not direct.available():
        pytest.skip("no direct loops")
    run = direct.register_run()
    wide_channels = ConvGeometry.create((1, 32, 4, 16, 16), (64, 32, 3, 3, 3), 1, 1)
    assert compiled_choice.winograd_forward(wide_channels, np.float32) == (16 * 8 >= 4 * run)
    assert not compiled_choice.winograd_forward(wide_channels, np.float64)
    few_channels = ConvGeometry.create((1, 16, 4, 64, 64), (32, 16, 3, 3, 3), 1, 1)
    assert compiled_choice.winograd_forward(few_channels, np.float32)  # 16: the bound
    thin = ConvGeometry.create((1, 8, 4, 64, 64), (32, 8, 3, 3, 3), 1, 1)
    assert not compiled_choice.winograd_forward(thin, np.float32)
    few_filters = ConvGeometry.create((1, 32, 4, 64, 64), (8, 32, 3, 3, 3), 1, 1)
    assert not compiled_choice.winograd_forward(few_filters, np.float32)
    small_planes = ConvGeometry.create((1, 256, 8, 8, 8), (512, 256, 3, 3, 3), 1, 1)
    assert compiled_choice.winograd_forward(small_planes, np.float32)  # one run a plane
    assert compiled_choice.filter_grad_kernel(small_planes, np.float32) == "lowered"
    assert compiled_choice.filter_grad_kernel(few_channels, np.float32) == "winograd"
    assert compiled_choice.winograd_tile(wide_channels) == 4
    assert compiled_choice.winograd_tile(small_planes) == 2
    not_3_wide = ConvGeometry.create((1, 32, 4, 16, 16), (64, 32, 3, 3, 1), 1, (1, 1, 0))
    assert not compiled_choice.winograd_forward(not_3_wide, np.float32)
    assert not compiled_choice.winograd_filter_grad(not_3_wide, np.float32)
    assert compiled_choice.winograd_filter_grad(few_channels, np.float32)  # 64 x 32 tiles a plane
    thin = ConvGeometry.create((1, 4, 4, 64, 64), (16, 4, 3, 3, 3), 1, 1)
    assert not compiled_choice.winograd_filter_grad(thin, np.float32)
    assert compiled_choice.winograd_filter_grad(wide_channels, np.float32)  # 16 x 8 tiles
    assert not compiled_choice.winograd_filter_grad(small_planes, np.float32)  # 8 x 4
    wide = ConvGeometry.create((1, 4, 8, 8, 4 * run), (16, 4, 3, 3, 3), 1, 1)
    assert compiled_choice.direct_loops(wide, np.float32)
    assert not compiled_choice.direct_loops(wide, np.float64)
    assert compiled_choice.forward_kernel(wide, np.float32) == "direct"
    assert compiled_choice.forward_kernel(wide, np.float64) == "lowered"
    assert compiled_choice.data_grad_kernel(wide, 16, np.float32) == "direct"
    assert compiled_choice.data_grad_kernel(wide, 1, np.float32) == "lowered"  # < a block
    strided = ConvGeometry.create((1, 4, 8, 8, 4 * run), (16, 4, 3, 3, 3), 2, 1)
    assert not compiled_choice.direct_loops(strided, np.float32)
    narrow = ConvGeometry.create((1, 4, 8, 8, run // 2), (16, 4, 3, 3, 3), 1, 1)
    assert not compiled_choice.direct_loops(narrow, np.float32)
    ragged = ConvGeometry.create((1, 4, 8, 8, run + run // 2), (16, 4, 3, 3, 3), 1, 1)
    assert not compiled_choice.direct_loops(ragged, np.float32)  # a third of the last run wasted


def test_layers_train_the_same_with_and_without_the_loops(monkeypatch) -> None:
    """conv3d_* on a CosmoFlow-like thin layer (direct loops) and a wider one
    (Winograd): the compiled loops and the lowerings agree."""
    if not direct.available():
        pytest.skip("no direct loops")
    rng = np.random.default_rng(7)
    run = direct.register_run()
    for c, f in ((4, 16), (32, 40)):
        x = rng.standard_normal((2, c, 6, 5, 2 * run)).astype(np.float32)
        w = rng.standard_normal((f, c, 3, 3, 3)).astype(np.float32)
        r = rng.standard_normal((2, f, 6, 5, 2 * run)).astype(np.float32)
        _compare_with_lowerings(x, w, r, monkeypatch)


def _compare_with_lowerings(x, w, r, monkeypatch) -> None:
    results = {}
    for use in (True, False):
        monkeypatch.setattr(compiled_choice, "USE_DIRECT", use)
        results[use] = (conv.conv3d_forward(x, w, 1, 1),
                        conv.conv3d_backward_filter(x, r, w.shape, 1, 1),
                        conv.conv3d_backward_data(r, w, x.shape, 1, 1))
    for ours, lowered in zip(results[True], results[False]):
        np.testing.assert_allclose(ours, lowered, rtol=1e-4, atol=1e-5 * np.abs(lowered).max())


def test_a_failed_allocation_in_the_loops_is_an_error() -> None:
    """The filter gradients and pooling report -1 when they cannot allocate their
    buffers (they then wrote no usable result): an error, never a silent partial sum."""
    from cosmotrain.kernels.compiled import library as compiled

    compiled.check(0, "x")
    with pytest.raises(MemoryError, match="Winograd filter gradient: out of memory"):
        compiled.check(-1, "Winograd filter gradient")


@pytest.mark.parametrize("tile", [2, 4])
def test_compiled_weight_transform_is_numpys_to_one_ulp(tile) -> None:
    """The C transform of the Winograd kernels (double sums, rounded) against the numpy
    form, filters not a multiple of the block included (the padding filters are 0)."""
    if winograd._weights_loop() is None:
        pytest.skip("the compiled loops were not built")
    w = np.random.default_rng(11).normal(size=(13, 5, 2, 3, 3)).astype(np.float32)
    ours = winograd.transformed_weights(w, 8, tile)
    numpy_form = winograd._transformed_weights_numpy(w, 8, tile)
    assert ours.shape == numpy_form.shape == (tile + 2, 2, 5, 2, 3, 8)
    np.testing.assert_array_max_ulp(ours, numpy_form, maxulp=1)
    assert not ours[:, 1, ..., 5:].any()
    with pytest.raises(ValueError, match="tiles are 2 or 4"):
        winograd.transformed_weights(w, 8, 3)
