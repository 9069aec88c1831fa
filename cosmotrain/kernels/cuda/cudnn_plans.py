"""cuDNN graphs once built: their cache, and the choice among their execution plans.

:mod:`.conv_cudnn` describes and builds one cuDNN Frontend graph per convolution call and
keeps it here (:class:`GraphCache`, :class:`GraphEntry`).  With ``cudnn_autotune`` a
graph holds every plan cuDNN's heuristics list; :func:`fastest_plan` and
:func:`event_seconds` pick the fastest on the first call's own buffers, as
``torch.backends.cudnn.benchmark`` does.  Nothing here imports cupy or cudnn: the GPU
objects are passed in, so the choice is tested on the CPU with stand-ins.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

class CudnnUnsupported(RuntimeError):
    """cuDNN has no engine for this convolution (after the precision filters)."""


@dataclass
class GraphEntry:
    """A built graph, its operand tensors by role and its workspace size in bytes.

    ``candidates``: plans built for autotuning (0: the heuristics' plan only);
    ``plan``: the index of the plan that runs once chosen (None: the graph's own).
    """

    graph: Any
    tensors: Dict[str, Any]
    workspace: int
    candidates: int = 0
    plan: Optional[int] = None

    @property
    def needs_tuning(self) -> bool:
        return self.candidates > 0 and self.plan is None


class GraphCache:
    """Built graphs by key, least recently used evicted beyond ``capacity`` entries."""

    def __init__(self) -> None:
        self._entries: "OrderedDict[tuple, Any]" = OrderedDict()
        self.builds = 0

    def get(self, key: tuple, build: Callable[[], Any], capacity: int) -> Any:
        """The entry for ``key``, built by ``build()`` on first use."""
        if key in self._entries:
            self._entries.move_to_end(key)
            return self._entries[key]
        entry = build()
        self.builds += 1
        self._entries[key] = entry
        while len(self._entries) > capacity:
            self._entries.popitem(last=False)
        return entry

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()


def largest_workspace(graph: Any, count: int) -> int:
    """The workspace every built plan fits in (a plan whose size cannot be read is left
    to fail, and be skipped, when it is timed)."""
    sizes = [0]
    for index in range(count):
        try:
            sizes.append(int(graph.get_workspace_size_plan_at_index(index)))
        except Exception:  # noqa: BLE001 - a plan that did not build
            continue
    return max(sizes)


def fastest_plan(count: int, seconds_of: Callable[[int], float]) -> Tuple[int, Dict[int, str]]:
    """``(index, failures)``: the plan with the least ``seconds_of(index)`` among
    ``count``, and why each plan that raised could not run.  Raises
    :class:`CudnnUnsupported` (its message lists the failures) when none runs."""
    best, best_seconds, failures = None, float("inf"), {}
    for index in range(count):
        try:
            seconds = seconds_of(index)
        except Exception as exc:  # noqa: BLE001 - cuDNN errors of one plan
            failures[index] = f"{type(exc).__name__}: {exc}"
            continue
        if seconds < best_seconds:
            best, best_seconds = index, seconds
    if best is None:
        raise CudnnUnsupported(f"no plan of {count} ran: {failures}")
    return best, failures


def event_seconds(cupy: Any, run: Callable[[], None], repeats: int = 2) -> float:
    """Seconds of one ``run()`` on the current stream, by CUDA events, after one untimed
    run (which also surfaces a plan's launch error before timing)."""
    run()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(repeats):
        run()
    end.record()
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) / 1e3 / repeats


def plan_name(graph: Any, index: int) -> str:
    try:
        return str(graph.get_plan_name_at_index(index))
    except Exception:  # noqa: BLE001 - a name only for the log
        return "unnamed"
