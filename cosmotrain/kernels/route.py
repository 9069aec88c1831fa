"""Where a kernel call runs, decided once and in one way for every front door.

Each front door (:mod:`.conv3d`, :mod:`.pool3d`, :mod:`.activation`, :mod:`.batchnorm`,
:mod:`.dropout`, :mod:`.linear`, :mod:`.loss`, :mod:`.optim_update`) asks
:func:`route` about its operands and sends the call to one back end:

* ``device``: cupy arrays, the CUDA back ends of :mod:`.cuda`;
* ``bf16``: bfloat16 storage (``precision: bf16``).  On the CPU it is widened to float32,
  computed by the float32 back ends and rounded back (:mod:`cosmotrain.precision`); on a
  device each CUDA back end says whether it takes bf16 natively;
* neither: float32 / float64 numpy arrays, the numpy back ends of :mod:`.cpu` or the
  compiled loops of :mod:`.compiled`.

Why one function: before, the device was told apart three ways (a module's own
``_elsewhere``, ``xp is not np``, and the CUDA convolution's own dispatch), and a kernel
could disagree with its neighbour about a bf16 device array.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from cosmotrain.device.xp import is_device_array
from cosmotrain.precision import is_bf16


@dataclass(frozen=True)
class Route:
    """The back end of one call: on a device or not, bfloat16 storage or not."""

    device: bool
    bf16: bool

    @property
    def cpu_float(self) -> bool:
        """float32 / float64 numpy: the CPU back ends' own dtypes."""
        return not (self.device or self.bf16)

    @property
    def cpu_bf16(self) -> bool:
        """bfloat16 numpy storage: widened, computed in float32 on the CPU, narrowed."""
        return self.bf16 and not self.device


def route(*arrays: Any) -> Route:
    """The route of a call on ``arrays`` (None entries ignored)."""
    present = [a for a in arrays if a is not None]
    return Route(device=any(is_device_array(a) for a in present),
                 bf16=any(is_bf16(a) for a in present))


def require_cpu_out(out: Optional[Any], where: Route) -> None:
    """``out=`` buffers are a CPU float32/float64 feature: refuse one elsewhere."""
    if out is not None and not where.cpu_float:
        raise ValueError("out= is supported for float32/float64 numpy arrays only")
