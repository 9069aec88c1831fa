"""Synthetic CosmoFlow universes whose 4 normalised parameters can be learned from the field.

Each sample is a toy N-body output built the way quick mock catalogues are built:

1. one Gaussian random field ``delta`` (the linear density contrast at ``z = 0``) with power
   spectrum ``P(k) = A * k**n * exp(-(k / k_c)**4)``.  Wavenumbers are physical (radians per
   voxel; the voxel size is fixed, the box grows with ``W``), so a parameter acts on the same
   physical scales at any width ``W``;
2. four redshift snapshots of that one field, ``D_c * delta``, scaled by the linear growth
   factor ``D_c = a_c**gamma`` with ``a_c = 1 / (1 + z_c)`` at ``z_c = REDSHIFTS[c]``;
3. a lognormal transform ``rho_c = exp(D_c * delta - D_c**2 * var_W / 2)``: positive, mean 1,
   skewed like the non-linear matter density (``var_W`` is the expected variance of ``delta``
   on this grid);
4. Poisson-sampled particle counts with mean ``MEAN_COUNT * rho_c`` (3) per voxel: small
   non-negative integers like the real CosmoFlow histograms.

The normalised parameters ``p`` in ``[-1, 1]`` (the ``unitPar`` labels) map to physics as
(see :func:`cosmology_from_params`):

- ``p[0]`` amplitude, like sigma_8: r.m.s. ``sigma = 0.8 * 2**(0.75 * p0)`` (0.48 to 1.35) of
  ``delta`` at ``z = 0``; ``A`` is set in closed form so that ``int P d^3k/(2 pi)^3 = sigma**2``,
  which keeps the amplitude independent of slope and cut-off.  Seen in the voxel variance.
- ``p[1]`` spectral slope, like n_s: ``n = -1 + 1.25 * p1`` (-2.25 to 0.25).  Seen in the ratio
  of large-scale to intermediate-scale power.
- ``p[2]`` small-scale cut-off, like a free-streaming (warm dark matter) scale:
  ``k_c = 2 * 2**p2`` radians per voxel (1 to 4, smoothing length ``2 pi / k_c`` of 6 to 1.6
  voxels).  Seen in how smooth the field is from voxel to voxel.
- ``p[3]`` growth history, like Omega_m / dark energy: growth exponent
  ``gamma = 1 + 0.4 * p3`` (0.6 to 1.4; 1 is matter-dominated growth ``D = a``).  Sets how much
  weaker the high-redshift channels are than the ``z = 0`` channel, which it leaves unchanged.

Everything random comes from a per-sample generator seeded by ``(seed, index, stream)``, so a
sample depends only on ``(seed, index, width)``: never on the rank count or the order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

GENERATOR_NAME = "cosmotrain.synthetic"
GENERATOR_VERSION = 1
NUM_PARAMS = 4
NUM_CHANNELS = 4
REDSHIFTS: tuple[float, ...] = (0.0, 0.5, 1.5, 3.0)
MEAN_COUNT = 3.0

SIGMA_MID, SIGMA_OCTAVES = 0.8, 0.75
SLOPE_MID, SLOPE_HALF_RANGE = -1.0, 1.25
CUTOFF_MID, CUTOFF_OCTAVES, CUTOFF_SHARPNESS = 2.0, 1.0, 4.0
GROWTH_MID, GROWTH_HALF_RANGE = 1.0, 0.4

_PARAM_STREAM = 0
_FIELD_STREAM = 1


@dataclass(frozen=True)
class Cosmology:
    """Physical parameters of one synthetic universe (decoded from ``unitPar``)."""

    sigma: float
    slope: float
    cutoff: float
    growth_exponent: float


def sample_rng(seed: int, index: int, stream: int) -> np.random.Generator:
    """Generator for one sample and purpose; keyed by global index so rank layout is irrelevant.

    ``stream`` separates the parameter draw from the field draw so they never share bits.
    """
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, index, stream])))


def sample_parameters(seed: int, index: int) -> np.ndarray:
    """The 4 normalised parameters (``unitPar``) of sample ``index``: float32 uniform in [-1, 1]."""
    rng = sample_rng(seed, index, _PARAM_STREAM)
    return rng.uniform(-1.0, 1.0, size=NUM_PARAMS).astype(np.float32)


def cosmology_from_params(params: np.ndarray) -> Cosmology:
    """Decode normalised parameters into physics (exponential maps: multiplicative effects)."""
    p = np.asarray(params, dtype=np.float64)
    if p.shape != (NUM_PARAMS,):
        raise ValueError(f"params must have shape ({NUM_PARAMS},), got {p.shape}")
    return Cosmology(
        sigma=SIGMA_MID * 2.0 ** (SIGMA_OCTAVES * p[0]),
        slope=SLOPE_MID + SLOPE_HALF_RANGE * p[1],
        cutoff=CUTOFF_MID * 2.0 ** (CUTOFF_OCTAVES * p[2]),
        growth_exponent=GROWTH_MID + GROWTH_HALF_RANGE * p[3],
    )


def spectrum_amplitude(cosmo: Cosmology) -> float:
    """``A`` such that the continuum variance ``int P(k) d^3k / (2 pi)^3`` equals ``sigma**2``.

    Closed form, valid for ``n > -3``: with ``s = CUTOFF_SHARPNESS``,
    ``int_0^inf k^(n+2) exp(-(k/k_c)^s) dk = k_c^(n+3) Gamma((n+3)/s) / s``.  Normalising the
    variance (rather than the raw prefactor), as sigma_8 does for real spectra, keeps the
    amplitude parameter independent of slope and cut-off, and the same at every ``W``.
    """
    n, kc, s = cosmo.slope, cosmo.cutoff, CUTOFF_SHARPNESS
    radial_integral = kc ** (n + 3.0) * math.gamma((n + 3.0) / s) / s
    return cosmo.sigma**2 * 2.0 * math.pi**2 / radial_integral


def wavenumbers(width: int) -> np.ndarray:
    """``|k|`` in radians per voxel on the ``rfftn`` half grid of a ``width**3`` cube."""
    k_full = 2.0 * np.pi * np.fft.fftfreq(width)
    k_half = 2.0 * np.pi * np.fft.rfftfreq(width)
    k2 = k_full[:, None, None] ** 2 + k_full[None, :, None] ** 2 + k_half[None, None, :] ** 2
    return np.sqrt(k2)


def power_spectrum(k: np.ndarray, cosmo: Cosmology) -> np.ndarray:
    """``P(k) = A k^n exp(-(k/k_c)^4)``, with the mean mode ``k = 0`` set to zero.

    The fourth power gives a sharp cut-off (like a warm dark matter transfer function), so
    the cut-off barely touches the large scales that carry the slope.
    """
    safe_k = np.where(k > 0.0, k, 1.0)
    shape = safe_k**cosmo.slope * np.exp(-((safe_k / cosmo.cutoff) ** CUTOFF_SHARPNESS))
    return np.where(k > 0.0, spectrum_amplitude(cosmo) * shape, 0.0)


def _half_grid_weights(width: int) -> np.ndarray:
    """Multiplicity of each ``rfftn`` column in the full spectrum (interior columns count twice)."""
    weights = np.full(width // 2 + 1, 2.0)
    weights[0] = 1.0
    if width % 2 == 0:
        weights[-1] = 1.0
    return weights


def gaussian_field(
    cosmo: Cosmology, width: int, rng: np.random.Generator
) -> tuple[np.ndarray, float]:
    """A periodic Gaussian random field with spectrum ``P`` and its expected variance on this grid.

    Colouring real white noise in Fourier space gives exact Hermitian symmetry for free.  With
    unit voxels, the filter is ``sqrt(P(k))`` and the expected variance is ``mean_k P(k)``; this
    grid variance (not the continuum ``sigma**2``) keeps the lognormal mean exactly 1 at any W.
    """
    power = power_spectrum(wavenumbers(width), cosmo)
    variance = float(np.sum(power * _half_grid_weights(width)) / width**3)
    noise = rng.standard_normal((width, width, width), dtype=np.float32)
    modes = np.fft.rfftn(noise) * np.sqrt(power).astype(np.float32)
    field = np.fft.irfftn(modes, s=noise.shape, axes=(0, 1, 2))
    return field.astype(np.float32, copy=False), variance


def growth_factors(cosmo: Cosmology) -> np.ndarray:
    """Linear growth ``D(z) = a^gamma`` of each snapshot relative to ``z = 0`` (so ``D(0) = 1``)."""
    scale_factors = 1.0 / (1.0 + np.asarray(REDSHIFTS, dtype=np.float64))
    return scale_factors**cosmo.growth_exponent


def poisson_counts(
    field: np.ndarray, variance: float, growth: float, rng: np.random.Generator
) -> np.ndarray:
    """Counts of one snapshot: Poisson draws from the lognormal density of ``growth * field``.

    Subtracting ``growth**2 * variance / 2`` in the exponent makes the expected density exactly
    ``MEAN_COUNT`` per voxel in every snapshot, as particle number is conserved in N-body runs.
    """
    log_density = growth * field.astype(np.float64) - 0.5 * growth**2 * variance
    mean_counts = MEAN_COUNT * np.exp(log_density)
    return rng.poisson(mean_counts).astype(np.float32)


def generate_volume(params: np.ndarray, width: int, seed: int, index: int) -> np.ndarray:
    """Particle counts of sample ``index``: float32 array of shape ``(4, W, W, W)`` (C, D, H, W).

    Channel ``c`` is the snapshot at ``REDSHIFTS[c]``; the result depends only on
    ``(params, width, seed, index)``.
    """
    cosmo = cosmology_from_params(params)
    rng = sample_rng(seed, index, _FIELD_STREAM)
    field, variance = gaussian_field(cosmo, width, rng)
    volume = np.empty((NUM_CHANNELS, width, width, width), dtype=np.float32)
    for channel, growth in enumerate(growth_factors(cosmo)):
        volume[channel] = poisson_counts(field, variance, float(growth), rng)
    return volume
