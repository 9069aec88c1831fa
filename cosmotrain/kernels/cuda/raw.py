"""Our own CUDA kernels: the ``.cu`` sources under ``src/``, their entry points and
argument types, NVRTC compilation, and launching them through cupy (a loaded
``cupy.cuda.function.Module``, what ``RawModule`` holds; see :func:`module`).

Why files, not strings: compilers, editors and CI see them.  Each source compiles once
per process (NVRTC, for the current device) into a loaded module, cached here, on
first use; nothing is compiled at
import, and importing this module imports no cupy.  The same sources are compiled by
NVRTC without a GPU in CI (:func:`nvrtc_compile`, tests/test_cuda_sources.py) and by
the host C++ compiler behind ``src/host_shim.h``, which runs them on the CPU against
the numpy kernels (tests/cuda_host.py).  See docs/GPU_KERNELS.md, "Our own kernels".

Every kernel is a grid-stride loop whose results do not depend on the grid, so a
launcher picks the grid freely (:func:`grid_for`); the few with a block-level barrier
(shared memory staged once per block) are listed in :data:`PHASES`, but for
batchnorm.cu's, whose barriers the host shim keeps as real ones (its per-channel sums
reduce in shared memory, a barrier at each level of the tree).
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

SOURCE_DIR = Path(__file__).parent / "src"
# Header every source includes, and the shim that stands in for CUDA on the host.
HEADERS = ("common.cuh", "host_shim.h")
ARCHITECTURES = ("sm_80", "sm_90")
# No flushing of float32 subnormals to zero (cupy's own compile path adds -ftz=true last,
# which would win: so modules are built here, see :func:`module`), no contraction into
# fused multiply-adds: the CPU's float32 bits (the sources' _rn intrinsics say it too).
NVRTC_OPTIONS = ("-std=c++17", "-ftz=false", "-fmad=false")
BLOCK = 256
# Most blocks a launch asks for: a grid-stride loop covers the rest (about 8 blocks of
# 256 threads per SM on 132 SMs, with room).
MAX_BLOCKS = 4096

# Argument codes: p a pointer (an array or None), i int32, l int64, f float32,
# d float64, u uint64.
_CODES = {"i": np.int32, "l": np.int64, "f": np.float32, "d": np.float64, "u": np.uint64}


def _both(source: str, name: str, codes: str) -> dict[str, tuple[str, str]]:
    """The float32 and bf16 entry points of one templated kernel (``COSMO_BOTH``)."""
    return {f"{name}_{kind}": (source, codes) for kind in ("f32", "bf16")}


# kernel name -> (source file, argument codes)
KERNELS: dict[str, tuple[str, str]] = {
    **_both("input.cu", "input_transform", "pppplilii"),
    **_both("epilogue.cu", "bias_leaky_relu", "ppplilf"),
    **_both("epilogue.cu", "leaky_relu_backward", "ppplff"),
    **_both("avgpool.cu", "avgpool_forward", "pplpf"),
    **_both("avgpool.cu", "avgpool_backward", "ppplpfiff"),
    **_both("maxpool.cu", "maxpool2_forward", "pppliii"),
    **_both("maxpool.cu", "maxpool2_backward", "pppliii"),
    **_both("dropout.cu", "dropout", "pppuupdf"),
    **_both("loss.cu", "mse", "ppplfpp"),
    **_both("linear.cu", "linear_partial", "ppppplllllll"),
    **_both("linear.cu", "linear_reduce", "ppplll"),
    **_both("linear.cu", "linear_wgrad", "pppplll"),
    **_both("conv_direct.cu", "conv_direct_forward", "pppp" + "i" * 15 + "f"),
    **_both("conv_direct.cu", "conv_direct_wgrad", "ppp" + "i" * 16 + "l"),
    **_both("conv_direct.cu", "conv_direct_wgrad_reduce", "pplll"),
    **_both("batchnorm.cu", "channel_sums", "ppplilii"),
    **_both("batchnorm.cu", "bn_forward", "ppppppplil"),
    **_both("batchnorm.cu", "bn_train_forward", "pppppppppddfilil"),
    **_both("batchnorm.cu", "bn_backward_apply", "ppppppplil"),
    "sgd_momentum_multi": ("optim.cu", "ppipp"),
    "adam_multi": ("optim.cu", "ppipp"),
    "nonfinite_flag": ("optim.cu", "plp"),
    "put_f64x8": ("scalars.cu", "pidddddddd"),
    "put_f32x8": ("scalars.cu", "piffffffff"),
}


# Kernels with block-level barriers (common.cuh's COSMO_PHASE / COSMO_SYNC): how many
# phases the host build runs one after the other over a block's threads.
PHASES: dict[str, int] = {"conv_direct_forward_f32": 2, "conv_direct_forward_bf16": 2}


def sources() -> list[Path]:
    """Every ``.cu`` source of the project."""
    return sorted(SOURCE_DIR.glob("*.cu"))


def suffix(dtype: Any) -> str:
    """``f32`` or ``bf16``: the entry point for a storage dtype."""
    name = np.dtype(dtype).name
    if name == "float32":
        return "f32"
    if name == "bfloat16":
        return "bf16"
    raise ValueError(f"our CUDA kernels store float32 or bfloat16, not {name}")


def grid_for(size: int, block: int = BLOCK) -> int:
    """Blocks for ``size`` elements, one thread each, capped at ``MAX_BLOCKS``."""
    return max(1, min(-(-size // block), MAX_BLOCKS))


def pack(kernel: str, args: Sequence[Any], address: Callable[[Any], Any]) -> list[Any]:
    """``args`` as the kernel's C types: numpy scalars, and ``address(array)`` for each
    pointer (None: a null pointer)."""
    codes = KERNELS[kernel][1]
    if len(codes) != len(args):
        raise TypeError(f"{kernel} takes {len(codes)} arguments, got {len(args)}")
    return [(np.uint64(0) if a is None else address(a)) if c == "p" else _CODES[c](a)
            for c, a in zip(codes, args)]


def include_dirs() -> list[str]:
    """NVRTC's include folders: ours, cupy's ``_core/include`` and the nvidia wheels'
    ``include`` folders (``cuda_bf16.h``); empty for a package that is not installed."""
    dirs = [str(SOURCE_DIR)]
    for package, pattern in (("cupy", "_core/include"), ("nvidia", "*/include")):
        spec = importlib.util.find_spec(package)
        for root in (spec.submodule_search_locations or []) if spec else []:
            dirs += [str(p) for p in sorted(Path(root).glob(pattern)) if p.is_dir()]
    return dirs


def _program(source: Path, options: Sequence[str], output: str) -> bytes:
    """NVRTC's ``output`` ("cubin" or "ptx") of ``source`` through the raw binding, which
    needs no GPU or driver (cupy's ``compile_using_nvrtc`` asks for the current device).
    Raises RuntimeError with NVRTC's log when the source does not compile."""
    from cupy.cuda import nvrtc  # type: ignore[import-not-found]

    options = [*options, *NVRTC_OPTIONS, *(f"-I{d}" for d in include_dirs())]
    program = nvrtc.createProgram(source.read_text(), source.name, [], [])
    try:
        nvrtc.compileProgram(program, options)
        result = nvrtc.getCUBIN(program) if output == "cubin" else nvrtc.getPTX(program)
    except nvrtc.NVRTCError as error:
        raise RuntimeError(f"{source.name} ({' '.join(options[:1])}): {error}\n"
                           f"{nvrtc.getProgramLog(program)}") from None
    finally:
        nvrtc.destroyProgram(program)
    return result if isinstance(result, bytes) else result.encode()


def nvrtc_compile(source: Path, arch: str) -> bytes:
    """The cubin of ``source`` for ``arch`` (``sm_90``), without a GPU."""
    return _program(source, [f"--gpu-architecture={arch}"], "cubin")


def nvrtc_ptx(source: Path, arch: str) -> str:
    """The PTX of ``source`` for the virtual ``arch`` (``compute_90``), without a GPU."""
    return _program(source, [f"--gpu-architecture={arch}"], "ptx").decode()


@functools.cache
def module(source: str) -> Any:
    """The loaded module of ``src/<source>`` for the current device, compiled once per
    process by :func:`nvrtc_compile` (not ``cupy.RawModule(code=...)``: its compile path
    appends -ftz=true, flushing float32 subnormals the CPU keeps)."""
    import cupy  # type: ignore[import-not-found]

    arch = f"sm_{cupy.cuda.Device().compute_capability}"
    loaded = cupy.cuda.function.Module()
    loaded.load(nvrtc_compile(SOURCE_DIR / source, arch))
    return loaded


def cupy_launch(kernel: str, size: int, args: Sequence[Any]) -> None:
    """Launch ``kernel`` on the current stream with a grid for ``size`` elements."""
    function = module(KERNELS[kernel][0]).get_function(kernel)
    function((grid_for(size),), (BLOCK,), tuple(pack(kernel, args, lambda a: a)))
