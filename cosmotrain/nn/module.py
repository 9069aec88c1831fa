"""The building blocks of the network engine: parameters, the layer protocol, the context.

Layers have explicit ``forward`` and ``backward`` methods (no autograd tape): a layer keeps
exactly what its backward needs, frees it after backward, and computes the input gradient
only when asked (``needs_input_grad``), so the first convolution never pays for a dgrad.
Parameter names follow PyTorch's ``state_dict`` keys (``conv1.weight``,
``layer1.0.bn1.bias``), so weights move between cosmotrain and an equivalent ``torch.nn``
model unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any


def layer_path(prefix: str, name: str) -> str:
    """Dotted name of a layer ``name`` under ``prefix`` ('' or ending in '.'); an unnamed
    layer (a residual block's body) takes its parent's name."""
    return f"{prefix}{name}" if name else prefix.rstrip(".")


class Parameter:
    """A trainable array with its gradient (``grad`` is None until backward sets it).

    ``shard`` is set when the array is only this rank's block of a larger parameter
    (channel/filter parallelism): it places the block in the full array.
    """

    def __init__(self, data: Any, shard: Any = None) -> None:
        self.data = data
        self.grad: Any = None
        self.shard = shard

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    def accumulate(self, grad: Any) -> None:
        """Set or add ``grad`` (a parameter used twice accumulates both contributions).

        Gradients are kept in the parameter's dtype: a bf16 kernel result is widened, so
        they accumulate in float32 like the master weights they update."""
        if grad.dtype != self.data.dtype:
            grad = grad.astype(self.data.dtype)
        if self.grad is None:
            self.grad = grad
        else:
            self.grad += grad

    def like(self, activations: Any) -> Any:
        """The parameter in the dtype of the ``activations`` it meets: the array itself,
        or (bf16 storage) its working copy rounded to bf16, as convolutions and linear
        layers read it in forward and in the data gradient."""
        if self.data.dtype == activations.dtype:
            return self.data
        return self.data.astype(activations.dtype)


@dataclass
class Context:
    """Per-step information a layer may need beyond its input.

    ``sample_offset`` / ``global_batch`` place the local samples in the global mini-batch
    so that dropout masks do not depend on the rank layout.  ``on_grad_ready`` is called
    with each layer as soon as its parameter gradients are final; the distributed trainer
    uses it to start gradient reductions while backward continues.
    """

    training: bool = True
    step: int = 0
    seed: int = 0
    sample_offset: int = 0
    global_batch: int | None = None
    on_grad_ready: Callable[[Layer], None] | None = None
    # ``step`` in device memory (a training step on a device, engine/step_scalars.py):
    # what dropout's kernel reads, so that a captured CUDA graph replays with each step's
    # own masks
    device_step: Any = None


@dataclass
class Layer:
    """Base class: subclasses implement ``forward``/``backward`` and declare ``params``."""

    name: str = ""
    params: dict[str, Parameter] = field(default_factory=dict)
    buffers: dict[str, Any] = field(default_factory=dict)
    needs_input_grad: bool = True

    def forward(self, x: Any, ctx: Context) -> Any:
        raise NotImplementedError

    def backward(self, dy: Any, ctx: Context) -> Any:
        raise NotImplementedError

    def children(self) -> list[Layer]:
        """Sub-layers (containers override); leaves have none."""
        return []

    def take_activation(self, slope: float | None) -> bool:
        """Apply the LeakyReLU (``slope``) that follows this layer to its own forward's
        output, where that saves the activation's pass over it; None: do not.  True when
        this layer will (:class:`~cosmotrain.nn.containers.Sequential` asks before each
        forward).  Layers that cannot say False."""
        return False

    def activation_slope(self) -> float | None:
        """The slope when this layer is a LeakyReLU the layer before may apply."""
        return None

    def set_applied_by_previous(self, applied: bool) -> None:
        """Told before forward whether the layer before applied this activation."""

    def take_activation_grad(self, y: Any, slope: float) -> bool:
        """Offered before backward: run the backward of the LeakyReLU after this layer
        (multiply the output gradient by its factor of its output ``y``) inside this
        layer's own kernels.  True when taken (the activation's backward is then
        skipped); layers that cannot say False."""
        return False

    def hand_over_backward(self, before: Sequence[Layer]) -> bool:
        """Offered before backward, with the layers ``before`` this one (nearest last):
        True when a layer before runs this backward (the container then skips it and
        hands dy on unchanged): an activation to the layer just before it
        (:meth:`take_activation_grad`).  Other layers have none to give."""
        return False

    def take_preceding_activation(self, before: Sequence[Layer]) -> None:
        """Offered before backward, with the layers ``before`` this one (nearest last):
        run the backward of the LeakyReLU just before this layer in this one's own pass
        (an average pooling: ``kernels/pool_activation.py``), where no layer before that
        activation takes it.  Layers that cannot do nothing."""

    def give_backward_to_next(self, before: Sequence[Layer]) -> tuple[Any, float] | None:
        """Asked by the layer after this one (:meth:`take_preceding_activation`) for this
        layer's backward as ``(y, slope)`` to run in its own pass: a LeakyReLU's.  Other
        layers have none to give (None), so an average pooling after a convolution, a
        batch norm or a block runs its own backward alone."""
        return None

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Parameter]]:
        """``(dotted name, parameter)`` in a stable order, PyTorch-style names."""
        base = f"{prefix}{self.name}." if self.name else prefix
        for key, param in self.params.items():
            yield base + key, param
        for child in self.children():
            yield from child.named_parameters(base)

    def named_buffers(self, prefix: str = "") -> Iterator[tuple[str, Layer, str]]:
        """``(dotted name, owning layer, key)`` of non-trainable state (BN running stats)."""
        base = f"{prefix}{self.name}." if self.name else prefix
        for key in self.buffers:
            yield base + key, self, key
        for child in self.children():
            yield from child.named_buffers(base)

    def named_layers(self, prefix: str = "") -> Iterator[tuple[str, Layer]]:
        """``(dotted name, layer)`` of this layer and every layer below it (the names of
        ``named_parameters`` without the parameter key, e.g. ``layer1.0.conv1``)."""
        path = layer_path(prefix, self.name)
        yield path, self
        for child in self.children():
            yield from child.named_layers(f"{path}." if path else "")

    def layers(self) -> Iterator[Layer]:
        """This layer and every layer below it, depth first."""
        yield self
        for child in self.children():
            yield from child.layers()

    def output_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Shape of the output for an input of ``shape`` (element-wise layers keep it)."""
        return shape
