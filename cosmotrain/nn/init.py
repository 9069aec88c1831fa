"""Seeded parameter initialisation, independent of construction order and rank layout.

Each parameter draws from its own generator seeded with (seed, crc32 of its name), so a
parameter's initial value depends only on the seed and its name: every rank of a
distributed run, and a run with a different model built around it, agree.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable

import numpy as np

from cosmotrain.nn.module import Layer

Initializer = Callable[[tuple[int, ...], np.random.Generator], np.ndarray]


def rng_for(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, zlib.crc32(name.encode())]))


def fans(shape: tuple[int, ...]) -> tuple[int, int]:
    """(fan_in, fan_out) for linear (out, in) and conv (F, C, k...) weights."""
    receptive = math.prod(shape[2:]) if len(shape) > 2 else 1
    return shape[1] * receptive, shape[0] * receptive


def glorot_uniform(shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Glorot/Xavier uniform (LBANN's and Keras's default): U(+-sqrt(6 / (in + out)))."""
    fan_in, fan_out = fans(shape)
    limit = math.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform(-limit, limit, size=shape).astype(np.float32)


def he_normal_fan_out(shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Kaiming normal, fan-out mode, ReLU gain (torchvision's ResNet convolutions)."""
    _, fan_out = fans(shape)
    return rng.normal(0.0, math.sqrt(2.0 / fan_out), size=shape).astype(np.float32)


def constant(value: float) -> Initializer:
    def fill(shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
        return np.full(shape, value, dtype=np.float32)

    return fill


def initialize(model: Layer, seed: int, rules: Callable[[str], Initializer]) -> None:
    """Fill every parameter of ``model`` with ``rules(name)(shape, rng_for(seed, name))``."""
    for name, param in model.named_parameters():
        param.data = rules(name)(param.shape, rng_for(seed, name))
