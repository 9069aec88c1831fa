"""A PyTorch depth-split peer of a ``torch.nn`` twin, over ``torch.distributed`` (gloo).

No PyTorch package here splits a 3D CNN along depth, so ``bench_ddp.py`` compares
cosmotrain's depth split (``parallel.depth=P``) against this one, written as a PyTorch
user would write it by hand:

* each rank holds ``D / P`` consecutive depth planes of every activation (the slab);
* before a convolution or pooling with a depth window (kernel k, stride s, padding p),
  :class:`HaloExchange` fetches the p planes below the slab and the ``k - p - s`` above it
  from the depth neighbours (zeros past the volume's ends: the zero padding), so the layer
  runs on the depth-padded slab with depth padding 0 (``isend`` / ``irecv``); its backward
  sends the halo planes' gradients back to their owners, which add them;
* 2x2x2 max-pooling and LeakyReLU are local (slabs hold even plane counts);
* before the first layer on whole samples (the same layer cosmotrain's spatial stop
  names, so both split the same layers) :class:`DepthGather` all-gathers the slabs along
  depth; its backward keeps the rank's slice of the gradient (the head after it runs
  replicated on every rank, so every rank holds the same gradient of the whole tensor);
* gradients: every rank saw part of the volume, so the split layers' weight and bias
  gradients are summed over the ranks (one coalesced allreduce after backward); the
  replicated head's are already equal everywhere and are not reduced.

``tests/test_bench_ddp.py`` checks the loss and every gradient against the one-process
twin (``bench_ddp.py --check``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

UP, DOWN = 1, 2  # message tags: towards the next / the previous depth rank


class HaloExchange(torch.autograd.Function):
    """``[below, slab, above]`` along depth: ``below`` planes from the previous rank (its
    last ones) and ``above`` planes from the next (its first ones); zeros at the ends."""

    @staticmethod
    def forward(ctx: Any, slab: torch.Tensor, below: int, above: int) -> torch.Tensor:
        ctx.widths = (below, above)
        depth = slab.shape[2]
        low, high = _exchange(slab[:, :, depth - below:], slab[:, :, :above], below, above)
        return torch.cat([low, slab, high], dim=2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        below, above = ctx.widths
        depth = grad.shape[2] - below - above
        inner = grad[:, :, below:below + depth].clone()
        # the halos' gradients go back to their owners; theirs of my planes come to me
        first, last = _exchange(grad[:, :, below + depth:], grad[:, :, :below], above, below)
        inner[:, :, :above] += first
        inner[:, :, depth - below:] += last
        return inner, None, None


def _exchange(to_next: torch.Tensor, to_previous: torch.Tensor, from_previous: int,
              from_next: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Send ``to_next`` to the next depth rank and ``to_previous`` to the previous one;
    returns the ``from_previous`` planes the previous rank sent and the ``from_next``
    planes the next one sent (zeros where there is no such rank)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    shape = list(to_next.shape)
    got_previous = to_next.new_zeros(shape[:2] + [from_previous] + shape[3:])
    got_next = to_next.new_zeros(shape[:2] + [from_next] + shape[3:])
    sent = [to_next.contiguous(), to_previous.contiguous()]  # alive until the waits
    works = []
    if rank + 1 < size:
        works += _pair(sent[0], got_next, rank + 1, send_tag=UP, recv_tag=DOWN)
    if rank > 0:
        works += _pair(sent[1], got_previous, rank - 1, send_tag=DOWN, recv_tag=UP)
    for work in works:
        work.wait()
    return got_previous, got_next


def _pair(send: torch.Tensor, recv: torch.Tensor, peer: int, send_tag: int,
          recv_tag: int) -> list[Any]:
    """Non-blocking send and receive with ``peer`` (nothing for an empty tensor)."""
    works = []
    if send.shape[2]:
        works.append(dist.isend(send, peer, tag=send_tag))
    if recv.shape[2]:
        works.append(dist.irecv(recv, peer, tag=recv_tag))
    return works


class DepthGather(torch.autograd.Function):
    """The whole depth from every rank's equal slab; backward keeps my slab's slice."""

    @staticmethod
    def forward(ctx: Any, slab: torch.Tensor) -> torch.Tensor:
        slab = slab.contiguous()
        parts = [torch.empty_like(slab) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, slab)
        ctx.depth = slab.shape[2]
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        start = dist.get_rank() * ctx.depth
        return grad[:, :, start:start + ctx.depth]


def depth_window(module: nn.Module) -> tuple[int, int, int] | None:
    """(kernel, stride, padding) along depth of a convolution or pooling; None otherwise."""
    if isinstance(module, (nn.Conv3d, nn.MaxPool3d)):
        return _depth(module.kernel_size), _depth(module.stride), _depth(module.padding)
    native = getattr(module, "native", None)  # torch_mirror.CountPadAvgPool
    if isinstance(native, nn.AvgPool3d):
        return _depth(native.kernel_size), _depth(native.stride), _depth(native.padding)
    return None


def _depth(value: Any) -> int:
    return int(value[0] if isinstance(value, (tuple, list)) else value)


def run_on_slab(module: nn.Module, slab: torch.Tensor) -> torch.Tensor:
    """``module`` on a depth slab: halos first when its depth window needs them."""
    window = depth_window(module)
    if window is None:
        return module(slab)
    kernel, stride, pad = window
    below, above = pad, kernel - pad - stride
    if slab.shape[2] % stride or max(below, above, 0) > slab.shape[2] or above < 0:
        raise ValueError(f"a {slab.shape[2]}-plane slab cannot run {module} on its own")
    if isinstance(module, nn.MaxPool3d):  # local only when its windows tile the slab
        if pad or kernel != stride:
            raise ValueError(f"the depth-split peer runs max-pooling only with depth windows "
                             f"that tile the volume (kernel = stride, no padding), not {module}")
        return module(slab)
    if below or above:
        slab = HaloExchange.apply(slab, below, above)
    return _unpadded_in_depth(module, slab)


def _unpadded_in_depth(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The layer on an input whose depth padding is already there (the halos)."""
    if isinstance(module, nn.Conv3d):
        return F.conv3d(x, module.weight, module.bias, module.stride,
                        (0, *module.padding[1:]), module.dilation, module.groups)
    pool = module.native  # average, zero padding counted (the twin's CountPadAvgPool)
    _, ph, pw = (pool.padding,) * 3 if isinstance(pool.padding, int) else pool.padding
    if all(s >= k for s, k in zip(x.shape[3:], pool.kernel_size[1:])):
        return F.avg_pool3d(x, pool.kernel_size, pool.stride, (0, ph, pw),
                            count_include_pad=True)
    x = F.pad(x, (pw, pw, ph, ph, 0, 0))
    return F.avg_pool3d(x, pool.kernel_size, pool.stride, 0)


class DepthSplitPeer(nn.Module):
    """The twin with its layers before ``stop`` on depth slabs and the rest replicated."""

    def __init__(self, twin: nn.Module, stop: str) -> None:
        super().__init__()
        self.twin = twin
        order = list(twin.order)
        cut = order.index(stop) if stop else len(order)
        self.split, self.head = order[:cut], order[cut:]

    def forward(self, slab: torch.Tensor) -> torch.Tensor:
        for name in self.split:
            slab = run_on_slab(getattr(self.twin, name), slab)
        x = DepthGather.apply(slab)
        for name in self.head:
            x = getattr(self.twin, name)(x)
        return x

    def split_parameters(self) -> list[nn.Parameter]:
        """Parameters of the layers on slabs: their gradients are summed over the ranks."""
        return [p for name in self.split for p in getattr(self.twin, name).parameters()]

    def reduce_gradients(self) -> None:
        """Sum the slab layers' gradients over the depth ranks (one coalesced message)."""
        grads = [p.grad for p in self.split_parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
