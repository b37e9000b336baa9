"""`load_hf_weights`: a HuggingFace checkpoint into the parameters of a built model.

Everything is checked from the safetensors headers first (every missing tensor, every
shape, every unused tensor, reported together in one WeightLoadError); only then is tensor
data read, converted and assembled (fuse, transform, stack_experts).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import torch

from runtime.hf_weights.checkpoint import Checkpoint
from runtime.hf_weights.errors import SHOWN, WeightLoadError, did_you_mean, listing, shape_text
from runtime.hf_weights.schema import Item, expand, fits, transform_of


class HFWeights(dict):
    """Parameters by concrete path (`blocks[3].attention.qkv_weight`), and what the load
    found out: `layout` (the part sizes of each fused parameter, by schema path, which
    export needs to split it again) and `unused` (checkpoint tensors mapped to no
    parameter, when loaded with allow_extra=True)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.layout: dict[str, list[int]] = {}
        self.unused: list[str] = []


def load_hf_weights(schema: list[dict], directory, dtype: torch.dtype | None = torch.float64,
                    device="cpu", progress: bool = True, allow_extra: bool = False) -> HFWeights:
    """Load the checkpoint in `directory` (model.safetensors, or a sharded
    model.safetensors.index.json; or one .safetensors file) for the build's `weight_schema`.

    Returns tensors keyed by concrete parameter path, converted to `dtype` (None keeps the
    checkpoint's) on `device`. A tied parameter is the same tensor object as its target;
    an optional parameter whose tensors are all absent is left out. Checkpoint tensors the
    model does not use are an error unless `allow_extra` (then listed in `.unused`).
    Raises WeightLoadError, listing every problem at once.
    """
    checkpoint = Checkpoint.open(directory)
    items = expand(schema)
    check = _Check(checkpoint)
    absent = _absent(items, checkpoint)
    loadable = [item for item in items if id(item.entry) not in absent and check.item(item)]
    check.report(allow_extra)
    weights = HFWeights()
    weights.layout, weights.unused = check.layout, check.unused
    loaded = _read(loadable, checkpoint, dtype, device, progress)
    for item in items:
        if item.path in loaded:
            weights[item.path] = loaded[item.path]
        elif item.kind == "tied" and item.target in loaded:
            weights[item.path] = loaded[item.target]  # one storage, as the model declares
    return weights


# ====================================================================== checks (headers only)
def _absent(items: list[Item], checkpoint: Checkpoint) -> set[int]:
    """The entries (by id) that may be absent and have none of their tensors, in any layer:
    left out. One that has some is loaded, and what it lacks is missing (a checkpoint whose
    layer 0 has a bias and layer 1 none is broken, not optional)."""
    found: dict[int, bool] = {}
    for item in items:
        if item.may_be_absent and item.kind != "tied":
            found[id(item.entry)] = found.get(id(item.entry), False) or any(
                n in checkpoint.shapes for n in item.sources())
    return {entry for entry, any_found in found.items() if not any_found}


class _Check:
    def __init__(self, checkpoint: Checkpoint):
        self.checkpoint = checkpoint
        self.missing: list[tuple[str, str]] = []  # (checkpoint name, parameter path)
        self.wrong: list[str] = []
        self.used: set[str] = set()
        self.layout: dict[str, list[int]] = {}
        self.unused: list[str] = []

    def item(self, item: Item) -> bool:
        """Whether the item loads: its tensors are all there with fitting shapes."""
        if item.kind == "tied":
            return False
        names = item.sources()
        present = [n for n in names if n in self.checkpoint.shapes]
        self.used.update(present)
        if len(present) < len(names):
            self.missing += [(n, item.path) for n in names if n not in present]
            return False
        before = len(self.wrong)
        if item.kind == "stack":
            self.stack(item)
        elif item.kind == "fuse":
            self.fuse(item, item.entry, item.names(), item.shape)
        else:
            expected = item.shape
            if item.kind == "transform":
                expected = transform_of(item).checkpoint_shape(expected)
            self.direct(item, item.names()[0], expected)
        return len(self.wrong) == before

    def direct(self, item: Item, name: str, expected: list, note: str = "") -> None:
        found = self.checkpoint.shapes[name]
        if not fits(found, expected):
            self.wrong.append(f"`{name}` is {shape_text(found)}; `{item.path}`{note} needs "
                              f"{shape_text(expected)}")

    def fuse(self, item: Item, plan: dict, names: list[str], shape: list,
             note: str = "") -> None:
        """The parts agree with the parameter off `dim` and add up to it along `dim`; their
        sizes go into the layout."""
        dim = plan["dim"]
        found = [self.checkpoint.shapes[n] for n in names]
        for name, part in zip(names, found):
            if len(part) != len(shape) or not fits(part[:dim] + part[dim + 1:],
                                                   shape[:dim] + shape[dim + 1:]):
                self.wrong.append(f"`{name}` is {shape_text(part)}; as a part of "
                                  f"`{item.path}`{note} {shape_text(shape)}, fused along dim "
                                  f"{dim}, it must be {_along(shape, dim)}")
                return
        sizes = [part[dim] for part in found]
        if isinstance(shape[dim], int) and sum(sizes) != shape[dim]:
            parts = " + ".join(str(s) for s in sizes)
            self.wrong.append(f"`{item.path}`{note} is {shape_text(shape)}, but its parts "
                              f"add up to {parts} = {sum(sizes)} along dim {dim} "
                              f"({', '.join(f'`{n}`' for n in names)})")
            return
        key = item.entry["param"]
        if self.layout.setdefault(key, sizes) != sizes:
            self.layout[item.path] = sizes

    def stack(self, item: Item) -> None:
        dim, inner = item.entry["dim"], item.entry["inner"]
        expert = item.shape[:dim] + item.shape[dim + 1:]
        for e in range(item.experts()):
            names, note = item.names(inner, e), f" (expert {e})"
            if inner["kind"] == "fuse":
                self.fuse(item, inner, names, expert, note)
            else:
                self.direct(item, names[0], expert, note)

    def report(self, allow_extra: bool) -> None:
        """One WeightLoadError for everything found, if anything was."""
        unused = [n for n in self.checkpoint.shapes if n not in self.used]
        if allow_extra:
            self.unused = unused
            unused_problem = []
        else:
            unused_problem = unused
        if not (self.missing or self.wrong or unused_problem):
            return
        lines, help = [f"cannot load {self.checkpoint.source} into this model"], []
        if self.missing:
            shown = [f"`{name}` (for `{path}`){did_you_mean(name, unused)}"
                     for name, path in self.missing[:SHOWN]]
            lines += listing(f"{_count(self.missing, 'tensor')} the model needs "
                             f"{_are(self.missing)} not in the checkpoint:", shown,
                             len(self.missing))
            help.append("the model's `hf_mapping:` names these tensors: is the checkpoint of "
                        "the same architecture?")
        if self.wrong:
            lines += listing(f"{_count(self.wrong, 'tensor')} of the wrong shape:", self.wrong)
            help.append("build the model with the checkpoint's config "
                        "(`modulec build --config DIR/config.json`) so that its sizes match")
        if unused_problem:
            lines += listing(f"{_count(unused, 'checkpoint tensor')} {_are(unused)} used by "
                             "no parameter:", [f"`{n}`" for n in unused])
            help.append("is the checkpoint of this architecture (extra tensors, such as "
                        "biases the program does not have, change the computation)? From "
                        "Python, `load_hf_weights(schema, directory, allow_extra=True)` "
                        "loads it anyway (the names are kept in `.unused`)")
        raise WeightLoadError("\n".join(lines), help)


def _along(shape: list, dim: int) -> str:
    return shape_text(["*" if d == dim else s for d, s in enumerate(shape)])


def _count(things: list, noun: str) -> str:
    return f"{len(things)} {noun}{'s' if len(things) != 1 else ''}"


def _are(things: list) -> str:
    return "is" if len(things) == 1 else "are"


# ====================================================================== reading
def _read(items: list[Item], checkpoint: Checkpoint, dtype, device, progress: bool) -> dict:
    """The loadable items' tensors; items with the same source share one tensor."""
    loaded, by_source = {}, {}
    total = len({n for item in items for n in item.sources()})
    with checkpoint.reader() as reader, _progress(total, progress) as advance:
        def get(name: str) -> torch.Tensor:
            advance()
            return _weight(name, reader.get(name)).to(device=device, dtype=dtype)

        for item in items:
            key = item.source_key()
            if key not in by_source:
                by_source[key] = _assemble(item, get)
            loaded[item.path] = by_source[key]
    return loaded


WEIGHT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def _weight(name: str, tensor: torch.Tensor) -> torch.Tensor:
    # An int64, bool or fp8 tensor converted silently gave a model of wrong numbers (fp8
    # needs its scales); only plain float weights are read. Unused tensors are not checked.
    if tensor.dtype not in WEIGHT_DTYPES:
        raise WeightLoadError(f"checkpoint tensor {name} is {str(tensor.dtype)[6:]}: weights "
                              "must be float64, float32, float16 or bfloat16",
                              ["the checkpoint is quantized or holds something else under "
                               "this name; convert it to a float dtype first"])
    return tensor


def _assemble(item: Item, get) -> torch.Tensor:
    if item.kind == "stack":
        inner = item.entry["inner"]
        experts = [_join(inner, item.names(inner, e), get) for e in range(item.experts())]
        return torch.stack(experts, dim=item.entry["dim"])
    if item.kind == "transform":
        return transform_of(item).forward(get(item.names()[0])).contiguous()
    return _join(item.entry, item.names(), get)


def _join(plan: dict, names: list[str], get) -> torch.Tensor:
    if plan["kind"] == "fuse":
        return torch.cat([get(n) for n in names], dim=plan["dim"])
    return get(names[0])


@contextmanager
def _progress(total: int, enabled: bool):
    """An `advance()` that moves a rich progress bar over the tensors read, shown only when
    asked for and stdout is a terminal (logs and tests stay quiet)."""
    if not enabled or not sys.stdout.isatty() or total == 0:
        yield lambda: None
        return
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeRemainingColumn)

    with Progress(TextColumn("loading weights"), BarColumn(), MofNCompleteColumn(),
                  TimeRemainingColumn(), transient=True) as bar:
        task = bar.add_task("load", total=total)
        yield lambda: bar.advance(task)
