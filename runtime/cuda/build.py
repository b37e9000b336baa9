"""Build the torch extension over csrc/ (bindings*.cpp + kernels/*.cu) with
torch.utils.cpp_extension.load: compiled once per source change into a cached build
folder (ninja rebuilds only what changed), then imported.

The target is the GPU at hand: Hopper (compute capability 9.0) gets sm_90a, others their
own `major.minor`; TORCH_CUDA_ARCH_LIST, when set, wins. MODULEC_CUDA_BUILD_DIR moves the
build folder (default: build/cuda_kernels in the checkout, ignored by git).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"
NAME = "modulec_cuda_kernels"


def sources() -> list[Path]:
    """bindings.cpp (the module), the other bindings_*.cpp it registers, kernels/*.cu."""
    return [CSRC / "bindings.cpp", *sorted(CSRC.glob("bindings_*.cpp")),
            *sorted((CSRC / "kernels").glob("*.cu"))]


def build_dir() -> Path:
    path = Path(os.environ.get("MODULEC_CUDA_BUILD_DIR", ROOT / "build" / "cuda_kernels"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def _arch_list() -> str:
    import torch

    major, minor = torch.cuda.get_device_capability()
    # 9.0a: Hopper's own instructions (the kernels use none yet; the flag costs nothing)
    return "9.0a" if (major, minor) == (9, 0) else f"{major}.{minor}"


@functools.cache
def load(verbose: bool = False):
    """The compiled extension module (built on the first call of a process)."""
    from torch.utils.cpp_extension import load as load_extension

    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", _arch_list())
    return load_extension(
        name=NAME,
        sources=[str(s) for s in sources()],
        extra_include_paths=[str(CSRC)],
        extra_cflags=["-O3", "-std=c++17"],
        extra_cuda_cflags=["-O3", "-std=c++17"],
        extra_ldflags=["-lcublasLt"],  # bindings_gemm.cpp (torch has loaded the library)
        build_directory=str(build_dir()),
        verbose=verbose,
    )
