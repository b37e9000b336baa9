"""Memory a model needs, checked before a byte of it is allocated (issue 16).

A lower bound, so a refusal is never wrong: the parameters (each in the dtype it is held
in) plus the largest single activation the program declares at its sizes (values of
symbolic shape count nothing), plus the planned saved-activation region when the runtime
lays activations out in an arena. It is compared with what the device can hold:

- CPU: MemAvailable + SwapFree of /proc/meminfo (free pages from `os.sysconf` where there
  is no /proc), and the cgroup's `memory.max` less its `memory.current` when that is less;
- CUDA: the free bytes `torch.cuda.mem_get_info` reports;
- or `--max-memory` / `max_memory=`, whichever is given.

One buffer that does not fit is named with its shape, dtype and bytes; otherwise the total.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from runtime.errors import RuntimeUserError

GIB = 2**30


def available_bytes(device) -> tuple[int, str]:
    """(bytes the device can still hold, how that was measured, for messages)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"GPU {device.index or 0} has free"
    return _host_available(), "this machine has available"


def _host_available() -> int:
    fields = _meminfo()
    if "MemAvailable" in fields:
        found = fields["MemAvailable"] + fields.get("SwapFree", 0)
    else:
        found = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    limit = _cgroup_room()
    return min(found, limit) if limit is not None else found


def _meminfo() -> dict[str, int]:
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return {}
    fields = {}
    for line in lines:
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            fields[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return fields


def _cgroup_room() -> int | None:
    """Bytes a cgroup-v2 memory limit still allows (None: no limit or no cgroup v2)."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = Path("/sys/fs/cgroup/memory.current").read_text().strip()
    except OSError:
        return None
    return max(0, int(limit) - int(used)) if limit.isdigit() and used.isdigit() else None


def check_memory(model, max_memory: int | None = None) -> None:
    """Refuse `model` (runtime.model.Model, before its weights are made) when its lower
    bound does not fit; a RuntimeUserError naming the buffer or the parts of the total."""
    if max_memory is not None:
        room, where = int(max_memory), "--max-memory allows"
    else:
        room, where = available_bytes(model.device)
    program = model.source.program(planned=False)
    parameters, activations = _parameters(model), _activations(program, model.dtype)
    for name, shape, dtype, size in parameters + activations:
        if size > room:
            raise RuntimeUserError(
                f"`{name}` {list(shape)} {_name(dtype)} needs {_gib(size)}, more than the "
                f"{_gib(room)} {where}", help=_help(max_memory))
    largest = max(activations, key=lambda b: b[3], default=None)
    saved = _saved_region(model)
    parameters = sum(b[3] for b in parameters)
    total = parameters + (largest[3] if largest else 0) + saved
    if total > room:
        parts = [f"parameters {_gib(parameters)}"]
        if largest:
            parts.append(f"the largest activation `{largest[0]}` {_gib(largest[3])}")
        if saved:
            parts.append(f"saved activations {_gib(saved)}")
        raise RuntimeUserError(f"the model needs at least {_gib(total)} ({', '.join(parts)}), "
                               f"more than the {_gib(room)} {where}", help=_help(max_memory))


def check_step_state(fixed: int, device, max_memory: int | None = None) -> None:
    """Refuse a GPU training step whose fixed state alone (weights, split masters, moments,
    held gradients: runtime.cuda.step.runtime_fixed_bytes) does not fit, before the step
    allocates it: it failed as an out-of-memory error in the middle of the allocation."""
    if max_memory is not None:
        room, where = int(max_memory), "--max-memory allows"
    else:
        room, where = available_bytes(device)
    if fixed > room:
        raise RuntimeUserError(
            f"the training step needs at least {_gib(fixed)} for its weights, masters and "
            f"optimizer state, more than the {_gib(room)} {where}",
            help=["train LoRA adapters only (--lora), shard the state over several GPUs "
                  "(torchrun ... --zero 3), or train a smaller model"])


def _parameters(model) -> list[tuple]:
    dtypes = model.parameter_dtypes()
    sized = {path: _known(shape) for path, shape in model.parameter_shapes().items()}
    return [(path, shape, dtypes[path], _numel(shape) * dtypes[path].itemsize)
            for path, shape in sized.items() if shape is not None]


def _activations(program, run_dtype: torch.dtype) -> list[tuple]:
    """The values of every forward function with a known shape, in the dtype the run holds
    them."""
    from modulec.types.tensor import FLOAT, FLOAT_DTYPES
    from runtime.kernels.utility import TORCH_DTYPES
    from runtime.model import _storage_dtype

    found, seen = [], set()
    for function in program.graph.functions:
        if function.gradient_of:  # a forward-only run makes none of these: not a bound
            continue
        for value in function.inputs + function.values:
            shape = _known(value.shape)
            if shape is None or (function.name, value.id) in seen:
                continue
            seen.add((function.name, value.id))
            if value.dtype == FLOAT or value.dtype in FLOAT_DTYPES:
                dtype = _storage_dtype(value.dtype, run_dtype)
            else:  # an integer tensor; int4 counted as a byte (a bound, not an estimate)
                dtype = TORCH_DTYPES.get(value.dtype, torch.uint8)
            found.append((f"{value.name or value.id}` of `{function.name}", shape,
                          dtype, _numel(shape) * dtype.itemsize))
    return found


def _saved_region(model) -> int:
    if not getattr(model, "arena", False):
        return 0
    layout = model.source.program(planned=False).document.get("schedule", {}).get("layout", {})
    return int((layout.get("regions") or {}).get("saved_activations", 0))


def _known(shape) -> tuple[int, ...] | None:
    try:
        return tuple(int(d) for d in shape)
    except (TypeError, ValueError):  # a dim without a size (a name)
        return None


def _numel(shape) -> int:
    count = 1
    for d in shape:
        count *= int(d)
    return count


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _gib(size: int) -> str:
    return f"{size / GIB:.2f} GiB" if size >= GIB / 100 else f"{size:,} bytes"


def _help(max_memory) -> list[str]:
    if max_memory is not None:
        return ["raise --max-memory, or run smaller sizes (--set, --shape)"]
    return ["run smaller sizes (--set, --shape), a smaller --dtype, or on a larger device"]
