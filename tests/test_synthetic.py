"""The synthetic CosmoFlow generator: determinism, normalisation, and learnable physics.

The physics tests draw 48 universes at W=32 and check that a simple field statistic tracks
the parameter that drives it (|Pearson r| > 0.8) with the expected sign, one test per
parameter.  The statistics are standard estimators, independent of the generator's code.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from cosmotrain.data.synthetic import universes as synthetic

PHYSICS_SEED, PHYSICS_SAMPLES, PHYSICS_WIDTH = 0, 48, 32


def test_parameters_deterministic_float32_in_unit_range() -> None:
    a = synthetic.sample_parameters(3, 7)
    assert a.dtype == np.float32 and a.shape == (4,)
    np.testing.assert_array_equal(a, synthetic.sample_parameters(3, 7))
    draws = np.stack([synthetic.sample_parameters(0, i) for i in range(200)])
    assert draws.min() >= -1.0 and draws.max() <= 1.0
    assert draws.min() < -0.9 and draws.max() > 0.9  # the whole range is used
    assert not np.array_equal(a, synthetic.sample_parameters(4, 7))


def test_volume_deterministic_and_keyed_by_seed_and_index() -> None:
    params = synthetic.sample_parameters(1, 2)
    first = synthetic.generate_volume(params, 16, 1, 2)
    assert first.shape == (4, 16, 16, 16) and first.dtype == np.float32
    assert first.tobytes() == synthetic.generate_volume(params, 16, 1, 2).tobytes()
    assert not np.array_equal(first, synthetic.generate_volume(params, 16, 1, 3))
    assert not np.array_equal(first, synthetic.generate_volume(params, 16, 2, 2))


@pytest.mark.parametrize("width", [8, 24])
def test_counts_are_small_nonnegative_integers(width: int) -> None:
    volume = synthetic.generate_volume(np.zeros(4, np.float32), width, 0, 0)
    assert volume.shape == (4, width, width, width)
    assert volume.min() >= 0 and np.array_equal(volume, np.rint(volume))
    assert 1.0 < volume.mean() < 6.0


def test_mean_count_is_conserved_across_snapshots() -> None:
    volume = synthetic.generate_volume(np.array([1, 0, 0, 1], np.float32), 48, 5, 0)
    np.testing.assert_allclose(volume.mean(axis=(1, 2, 3)), synthetic.MEAN_COUNT, rtol=0.1)


@pytest.mark.parametrize("slope, cutoff", [(-2.25, 1.0), (-1.0, 2.0), (0.25, 4.0)])
def test_spectrum_normalised_to_sigma_squared(slope: float, cutoff: float) -> None:
    """Numerical radial integral of P(k) k^2 / (2 pi^2) against the closed-form amplitude."""
    cosmo = synthetic.Cosmology(sigma=0.7, slope=slope, cutoff=cutoff, growth_exponent=1.0)
    log_k = np.linspace(math.log(1e-9), math.log(50.0), 200_001)
    k = np.exp(log_k)
    integrand = synthetic.power_spectrum(k, cosmo) * k**3 / (2.0 * math.pi**2)
    assert np.trapezoid(integrand, log_k) == pytest.approx(0.49, rel=1e-3)


def test_field_variance_matches_expected_grid_variance() -> None:
    cosmo = synthetic.Cosmology(sigma=0.8, slope=0.0, cutoff=2.0, growth_exponent=1.0)
    field, variance = synthetic.gaussian_field(cosmo, 64, synthetic.sample_rng(0, 0, 1))
    assert abs(field.mean()) < 0.01
    assert field.var() == pytest.approx(variance, rel=0.05)
    assert variance == pytest.approx(0.64, rel=0.05)  # little power lies outside a 64^3 box


def test_growth_is_one_today_and_decreasing_with_redshift() -> None:
    for exponent in (0.6, 1.0, 1.4):
        cosmo = synthetic.Cosmology(0.8, -1.0, 2.0, exponent)
        growth = synthetic.growth_factors(cosmo)
        assert growth[0] == 1.0 and np.all(np.diff(growth) < 0)


# ---- physics: each parameter is visible in a field statistic --------------------------


def _band_power(field: np.ndarray, k_low: float, k_high: float) -> float:
    """Mean power of ``field`` in the shell k_low <= |k| < k_high (radians per voxel)."""
    power = np.abs(np.fft.rfftn(field - field.mean())) ** 2
    k = synthetic.wavenumbers(field.shape[0])
    return float(power[(k >= k_low) & (k < k_high)].mean())


def _lognormal_variance(counts: np.ndarray) -> float:
    """Variance of log density: ``log(1 + (var - mean) / mean^2)`` removes Poisson noise."""
    mean = counts.mean()
    return float(np.log1p((counts.var() - mean) / mean**2))


def _roughness(counts: np.ndarray) -> float:
    """log of neighbour-difference variance over voxel variance, both minus Poisson noise."""
    mean = counts.mean()
    diff = np.mean([np.var(np.roll(counts, 1, axis=a) - counts) for a in range(3)]) - 2 * mean
    return float(np.log(max(diff, 1e-6) / (counts.var() - mean)))


def _statistics(volume: np.ndarray) -> list[float]:
    today, log_today = volume[0], np.log1p(volume[0])
    return [
        float(np.var(log_today)),
        math.log(_band_power(log_today, 0.15, 0.5) / _band_power(log_today, 0.5, 0.9)),
        _roughness(today),
        math.log(_lognormal_variance(volume[2]) / _lognormal_variance(today)),
    ]


@pytest.fixture(scope="module")
def ensemble() -> tuple[np.ndarray, np.ndarray]:
    """(params [S, 4], statistics [S, 4]) over a small ensemble of universes."""
    params, stats = [], []
    for index in range(PHYSICS_SAMPLES):
        p = synthetic.sample_parameters(PHYSICS_SEED, index)
        params.append(p)
        stats.append(_statistics(synthetic.generate_volume(p, PHYSICS_WIDTH, PHYSICS_SEED, index)))
    return np.array(params), np.array(stats)


def _pearson(ensemble: tuple[np.ndarray, np.ndarray], param: int, stat: int) -> float:
    params, stats = ensemble
    return float(np.corrcoef(params[:, param], stats[:, stat])[0, 1])


def test_amplitude_p0_drives_voxel_variance(ensemble) -> None:
    assert _pearson(ensemble, 0, 0) > 0.9


def test_slope_p1_drives_large_to_intermediate_power_ratio(ensemble) -> None:
    assert _pearson(ensemble, 1, 1) < -0.8  # steeper (more negative n): more large-scale power


def test_cutoff_p2_drives_small_scale_roughness(ensemble) -> None:
    assert _pearson(ensemble, 2, 2) > 0.8  # higher k_c: more structure from voxel to voxel


def test_growth_p3_drives_high_redshift_clustering(ensemble) -> None:
    assert _pearson(ensemble, 3, 3) < -0.8  # higher gamma: weaker clustering at z = 1.5
