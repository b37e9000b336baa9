"""`export_hf_tensors` and `save_hf_weights`: parameters (or their gradients) back under
the checkpoint's names, the inverse of `load_hf_weights`.

Fused parameters are split at the part sizes the load recorded (`HFWeights.layout`), or
that the caller gives (`layout=`): the schema does not hold them (decisions.md, "Weight
mapping (issue 3)"). Tied parameters export nothing of their own; for gradients, a tied
parameter's gradient is added to its target's (one checkpoint tensor, two uses).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from runtime.hf_weights.checkpoint import SINGLE
from runtime.hf_weights.errors import (SHOWN, WeightLoadError, did_you_mean, listing,
                                       shape_text)
from runtime.hf_weights.schema import Item, expand, fits, transform_of


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
                    layout: dict[str, list[int]] | None = None) -> Path:
    """Export the parameters and write `directory/model.safetensors` (cast to `dtype` when
    given) and, with `config`, `config.json`; each file is written whole to a temporary
    file and renamed into place, so a crash never leaves half a checkpoint. Returns the
    safetensors path."""
    exported = export_hf_tensors(schema, tensors, layout=layout)
    directory = Path(directory).expanduser()
    directory.mkdir(parents=True, exist_ok=True)
    ready = {name: _own(t.detach().to(dtype=dtype or t.dtype, device="cpu"))
             for name, t in exported.items()}
    path = directory / SINGLE
    _atomic(path, lambda tmp: save_file(ready, tmp, metadata={"format": "pt"}))
    if config is not None:
        text = json.dumps(config, indent=2, sort_keys=True) + "\n"
        _atomic(directory / "config.json", lambda tmp: Path(tmp).write_text(text, "utf-8"))
    return path


def _own(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor with storage of its own: safetensors refuses views that share
    memory (the parts of a split fused weight do)."""
    tensor = tensor.contiguous()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()
    return tensor


def _atomic(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


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
