"""Per-layer wall-clock timing of forward and backward (benchmarks, trainer metrics).

Wraps the leaf layers' ``forward``/``backward`` of a model instance in timers; the model
itself is unchanged and :meth:`LayerTimer.remove` restores it.  On a GPU the layers only
queue work: give ``sync`` (the device's synchronize) and each layer's time is its device
work, at the price of the overlap between layers that the synchronisation removes.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from cosmotrain.nn.module import Layer


class LayerTimer:
    """Accumulates seconds per (layer name, phase) while installed on a model."""

    def __init__(self, *models: Layer, sync: Callable[[], None] | None = None) -> None:
        """Times the leaves of every model given (a hybrid model's parts: its spatial
        sequence, the redistribution, the head)."""
        self.seconds: dict[tuple[str, str], float] = defaultdict(float)
        self._sync = sync if sync is not None else (lambda: None)
        self._wrapped: list[Layer] = []
        for model in models:
            for prefix, layer in _named_leaves(model):
                self._wrap(prefix, layer)

    def _wrap(self, name: str, layer: Layer) -> None:
        for phase in ("forward", "backward"):
            original = getattr(layer, phase)
            setattr(layer, phase, self._timed(name, phase, original))
        self._wrapped.append(layer)

    def _timed(self, name: str, phase: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any) -> Any:
            self._sync()
            start = time.perf_counter()
            result = call(*args)
            self._sync()
            self.seconds[(name, phase)] += time.perf_counter() - start
            return result

        return timed

    def remove(self) -> None:
        for layer in self._wrapped:
            for phase in ("forward", "backward"):
                layer.__dict__.pop(phase, None)
        self._wrapped.clear()

    def reset(self) -> None:
        self.seconds.clear()


def _named_leaves(layer: Layer) -> list[tuple[str, Layer]]:
    """The layers that compute: no children, and not an empty container (a hybrid
    model's spatial sequence is empty when every layer runs on whole samples)."""
    return [(name, leaf) for name, leaf in layer.named_layers()
            if not leaf.children() and type(leaf).children is Layer.children]
