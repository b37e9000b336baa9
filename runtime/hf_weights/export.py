"""`export_hf_tensors` and `save_hf_weights`: parameters (or their gradients) back under
the checkpoint's names, the inverse of `load_hf_weights`.

Fused parameters are split at the part sizes the load recorded (`HFWeights.layout`), or
that the caller gives (`layout=`): the schema does not hold them (decisions.md, "Weight
mapping (issue 3)"). Tied parameters export nothing of their own; for gradients, a tied
parameter's gradient is added to its target's (one checkpoint tensor, two uses).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from runtime.hf_weights.errors import (SHOWN, WeightLoadError, did_you_mean, listing,
                                       shape_text)
from runtime.hf_weights.schema import Item, expand, fits, transform_of
from runtime.hf_weights.stream import (MAX_SHARD_SIZE, Spec, StreamCheckpoint,
                                        atomic_text)


def export_hf_tensors(schema: list[dict], tensors: dict[str, torch.Tensor], *,
                      gradients: bool = False, layout: dict[str, list[int]] | None = None,
                      weights: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The tensors (parameter path -> tensor) under their checkpoint names, in schema order.

    Weights (default): every parameter that is not tied or optional must be given; a tied
    parameter, if given, must equal its target. Gradients (`gradients=True`): parameters
    without a gradient (frozen) may be absent; a tied parameter's gradient is summed into
    its target's, and a nonlinear transform (exp, log, negate_exp) needs the parameter
    values (`weights=`) for its chain rule. `layout` (schema or concrete path -> part sizes)
    defaults to the `.layout` of `tensors` or `weights` as returned by load_hf_weights.
    """
    items = expand(schema)
    layout = {**getattr(weights, "layout", {}), **getattr(tensors, "layout", {}),
              **(layout or {})}
    export = _Export(items, gradients, layout, weights or {})
    values = export.prepare(dict(tensors))
    out: dict[str, torch.Tensor] = {}
    for item in items:
        if item.kind != "tied" and item.path in values:
            for name, tensor in export.item(item, values[item.path]):
                export.put(out, name, tensor, item)
    export.report()
    return out


def save_hf_weights(schema: list[dict], tensors: dict[str, torch.Tensor], directory,
                    config: dict | None = None, *, dtype: torch.dtype | None = None,
                    layout: dict[str, list[int]] | None = None,
                    max_shard_size: int = MAX_SHARD_SIZE) -> Path:
    """Export the parameters and write `directory/model.safetensors` (above
    `max_shard_size` bytes, HF's shards and index: runtime.hf_weights.stream), cast to
    `dtype` when given, and, with `config`, `config.json`; each file goes through a
    temporary file renamed into place, so a crash never leaves half a checkpoint. The
    tensors are converted and written one at a time. Returns the (first) safetensors
    path."""
    shapes = {p: tuple(t.shape) for p, t in tensors.items()}
    layout = {**getattr(tensors, "layout", {}), **(layout or {})}
    plan = StreamExport(schema, shapes, layout,
                        dtype or {p: t.dtype for p, t in tensors.items()})
    plan.check_tied(tensors)
    directory = Path(directory).expanduser()
    directory.mkdir(parents=True, exist_ok=True)
    out = StreamCheckpoint(directory, plan.specs, max_shard_size)
    try:
        for path in plan.paths:
            for name, tensor in plan.convert(path, tensors[path]):
                out.write(name, tensor)
        written = out.close()
    except BaseException:
        out.abort()
        raise
    if config is not None:
        write_config(directory, config)
    return written


def write_config(directory: Path, config: dict) -> None:
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    atomic_text(Path(directory) / "config.json", text)


class StreamExport:
    """The checkpoint's tensors of parameters given by shape alone (`shapes`, path ->
    shape): their names, shapes and `dtype` in schema order (`specs`, for the header of
    a streamed file), checked as export_hf_tensors checks; then `convert(path, value)`
    gives one parameter's tensors, cast to `dtype` (or a dict: each path's), as
    export_hf_tensors would."""

    def __init__(self, schema: list[dict], shapes: dict, layout: dict | None,
                 dtype: torch.dtype | dict):
        items = expand(schema)
        self.dtype, self.export = dtype, _Export(items, False, layout or {}, {})
        tied = self.export.items
        metas = self.export.prepare({p: torch.empty(s, device="meta")  # ties: check_tied
                                     for p, s in shapes.items()
                                     if p not in tied or tied[p].kind != "tied"})
        self.paths, self.specs, names = [], [], set()
        for item in items:
            if item.kind == "tied" or item.path not in metas:
                continue
            self.paths.append(item.path)
            for name, meta in self.export.item(item, metas[item.path]):
                if name in names:
                    self.export.problem("tied", f"`{item.path}` exports `{name}` again")
                names.add(name)
                self.specs.append(Spec(name, tuple(meta.shape), self.dtype_of(item.path)))
        self.export.report()

    def check_tied(self, tensors: dict) -> None:
        """Tied parameters given with the others must equal their targets (as
        export_hf_tensors checks)."""
        for path, item in self.export.items.items():
            if item.kind == "tied" and path in tensors:
                self.export.tied(tensors, item)
        self.export.report()

    def convert(self, path: str, value: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        item = self.export.items[path]
        pairs = self.export.item(item, value.detach())
        self.export.report()
        dtype = self.dtype_of(path)
        return [(name, t.to(dtype=dtype, device="cpu").contiguous()) for name, t in pairs]

    def dtype_of(self, path: str) -> torch.dtype:
        return self.dtype[path] if isinstance(self.dtype, dict) else self.dtype


# ====================================================================== the export
class _Export:
    def __init__(self, items: list[Item], gradients: bool, layout: dict, weights: dict):
        self.items = {item.path: item for item in items}
        self.gradients = gradients
        self.layout = layout
        self.weights = weights
        self.problems: dict[str, list[str]] = {}

    def problem(self, kind: str, line: str) -> None:
        self.problems.setdefault(kind, []).append(line)

    def prepare(self, values: dict) -> dict:
        """Check names and shapes; fold or check the tied parameters."""
        for path in values:
            if path not in self.items:
                self.problem("unknown", f"`{path}`{did_you_mean(path, self.items)}")
        for path, item in self.items.items():
            value = values.get(path)
            if value is None:
                if not (self.gradients or item.kind == "tied" or item.may_be_absent):
                    self.problem("missing", f"`{path}`")
            elif not isinstance(value, torch.Tensor):
                self.problem("shape", f"`{path}` is a {type(value).__name__}, not a tensor")
            elif not fits(list(value.shape), item.shape):
                self.problem("shape", f"`{path}` is {shape_text(value.shape)}, the "
                                      f"model's is {shape_text(item.shape)}")
            else:
                continue
            values.pop(path, None)  # reported: not exported (nor folded into a tied target)
        for path, item in self.items.items():
            if item.kind == "tied" and path in values:
                self.tied(values, item)
        return values

    def tied(self, values: dict, item: Item) -> None:
        target, value = item.target, values[item.path]
        if self.gradients:
            values[target] = values[target] + value if target in values else value
        elif target in values and value is not values[target] and \
                not torch.equal(value, values[target]):
            self.problem("tied", f"`{item.path}` differs from `{target}`, which it is tied to")

    def item(self, item: Item, value: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        value = value.detach()
        if item.kind == "stack":
            inner, pairs = item.entry["inner"], []
            for e, expert in enumerate(value.unbind(item.entry["dim"])):
                pairs += self.split(item, inner, item.names(inner, e), expert)
            return pairs
        if item.kind == "transform":
            return [(item.names()[0], self.inverse(item, value))]
        return self.split(item, item.entry, item.names(), value)

    def split(self, item: Item, plan: dict, names: list[str], value) -> list:
        if plan["kind"] != "fuse":
            return [(names[0], value)]
        dim = plan["dim"]
        sizes = self.layout.get(item.path) or self.layout.get(item.entry["param"])
        if sizes is None or len(sizes) != len(names) or sum(sizes) != value.shape[dim]:
            self.problem("layout", f"`{item.path}` {shape_text(value.shape)} into "
                         f"{len(names)} parts along dim {dim}: sizes "
                         f"{'unknown' if sizes is None else sizes}")
            return []
        return list(zip(names, value.split(list(sizes), dim=dim)))

    def inverse(self, item: Item, value: torch.Tensor) -> torch.Tensor:
        transform = transform_of(item)
        if not self.gradients:
            return transform.inverse(value)
        weight = self.weights.get(item.path)
        if weight is None and not transform.linear:
            self.problem("chain", f"`{item.path}` (fn `{item.entry['fn']}`)")
            return value
        return transform.grad(value, None if weight is None else weight.detach())

    def put(self, out: dict, name: str, tensor: torch.Tensor, item: Item) -> None:
        """Two parameters exporting one checkpoint tensor (a tied parameter mapped to its
        target's names): weights must agree, gradients add up."""
        if name not in out:
            out[name] = tensor
        elif self.gradients:
            out[name] = out[name] + tensor
        elif not torch.equal(out[name], tensor):
            self.problem("tied", f"`{item.path}` exports `{name}` with other values than "
                                 "the parameter exported there before")

    def report(self) -> None:
        if not self.problems:
            return
        what = "gradients" if self.gradients else "weights"
        lines, help = [f"cannot export these {what} to the checkpoint's names"], []
        for kind, found in self.problems.items():
            title, hint = _PROBLEMS[kind]
            lines += listing(title, found[:SHOWN], len(found))
            help.append(hint)
        raise WeightLoadError("\n".join(lines), help)


_PROBLEMS = {
    "unknown": ("not parameters of the model:",
                "keys are concrete parameter paths, as load_hf_weights returns them"),
    "missing": ("parameters not given (a checkpoint needs every one):",
                "pass all the model's parameters, or gradients=True for gradients"),
    "shape": ("of the wrong shape:", "give each parameter the shape of the built model"),
    "tied": ("tied parameters that differ:",
             "a tied parameter shares its target's storage: give the same tensor"),
    "layout": ("fused parameters that cannot be split:",
               "export the dict load_hf_weights returned (it carries `.layout`), or pass "
               "layout={'blocks[{i}].attention.qkv_weight': [q, k, v], ...}"),
    "chain": ("gradients through a nonlinear transform, without the parameter's value:",
              "pass weights=the parameters (the chain rule needs them)"),
}
