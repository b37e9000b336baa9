"""The GPU step's fixed state as regions of the memory plan: one device allocation each,
every tensor a view at its offset (issue 6 item 1, for the fixed regions).

- `weights`: the compute copies (bf16) of every parameter, frozen ones included: the
  plan's weights region.
- `optimizer_state`: per trained parameter, the low half of its fp32 master (int16), then
  the two AdamW moments (fp32): 10 bytes a parameter, within the plan's optimizer-state
  region (12: an fp32 master and the moments). A master is held split (`split_master`):
  its bf16 compute copy in `weights` is its top 16 bits rounded half away from zero, its
  low half what that rounding took off, so bits(master) = bits(hi) * 2^16 + lo exactly;
  master and compute copy take 4 bytes a parameter instead of 6 (csrc/kernels/adamw.cu
  updates both halves in place; `joined_master` gives the fp32 value).
- `gradient_sums` (with gradient accumulation): an fp32 sum per trained parameter.

Parameters are placed in path order, each at a 256-byte boundary, as the reference
runtime's arena places them (runtime/arena.py ParameterRegions), except that the
parameters a `concat` along dim 0 stacks (LoRA's per-part A of a fused projection) lie
side by side in the concat's order (`stacked_order`): the concat is then a view of them,
no copy a step. The per-layer gradients
of the step have no region: each lives from its layer's backward to that layer's update.
`random_params` draws a step's first weights (TrainStep.init_random).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

ALIGNMENT = 256


def parameter_groups(graph, paths, takes) -> list[tuple]:
    """(node, member paths) for each op of `graph` whose inputs are all parameters and that
    `takes(node)` accepts, once per layer that runs it: the members are its inputs' full
    paths among `paths` (the layer's prefix before each input's name)."""
    present, groups = set(paths), []
    for node in (n for f in graph.functions for n in f.nodes
                 if n.kind == "op" and n.inputs and takes(n)
                 and all(v.startswith("param:") for v in n.inputs)):
        names = [v[len("param:"):] for v in node.inputs]
        for path in paths:
            if path != names[0] and not path.endswith("." + names[0]):
                continue
            members = [path[:len(path) - len(names[0])] + name for name in names]
            if all(m in present for m in members):
                groups.append((node, members))
    return groups


def stacked_order(graph, paths: list) -> list:
    """`paths` with the parameters each dim-0 `concat` of parameters stacks (in any
    function of `graph`, once per layer that calls it) moved together, in the concat's
    order, to where the first of them was; the others stay in their order."""
    group = {}
    for _, members in parameter_groups(
            graph, paths, lambda n: n.target == "concat" and n.attr("dim") == 0
            and len(n.inputs) > 1):
        if not any(m in group for m in members):
            group.update({m: members for m in members})
    ordered, placed = [], set()
    for path in paths:
        if path in placed:
            continue
        members = group.get(path, [path])
        ordered += members
        placed.update(members)
    return ordered


def region(shapes: dict, paths: list, dtypes: tuple, device: str = "cuda"
           ) -> tuple[torch.Tensor, list[dict]]:
    """One zeroed allocation holding a block per dtype of `dtypes`, each the parameters
    `paths` in that dtype; returns it and, per block, {path: view}."""
    return region_of(shapes, [(dtype, paths) for dtype in dtypes], device)


def region_of(shapes: dict, blocks: list, device: str = "cuda", sides: dict | None = None,
              tails: dict | None = None) -> tuple[torch.Tensor, list[dict]]:
    """One zeroed allocation holding a block per (dtype, paths) of `blocks`; returns it
    and, per block, {path: view}. `sides`: {path of a 2-D parameter: n}: its rows laid n
    elements apart more than its width (n spare columns beside each row: LoRA's s B for
    the one-GEMM path, runtime/cuda/lora_kcat.py); its view is then strided. `tails`:
    {path of a 2-D parameter: n}: n spare rows laid right after its own (LoRA's A for the
    backward's one-GEMM d_x); its view stays contiguous."""
    sides, tails = sides or {}, tails or {}
    placed, end = [], 0
    for dtype, paths in blocks:
        size, offsets = torch.empty((), dtype=dtype).element_size(), {}
        for path in paths:
            offsets[path] = end
            laid = _laid(shapes[path], sides.get(path, 0), tails.get(path, 0))
            end += -(-_numel(laid) * size // ALIGNMENT) * ALIGNMENT
        placed.append((dtype, offsets))
    buffer = torch.zeros(end, dtype=torch.uint8, device=device)
    views = [{p: _view(buffer, start, shapes[p], dtype, sides.get(p, 0), tails.get(p, 0))
              for p, start in offsets.items()} for dtype, offsets in placed]
    return buffer, views


def _laid(shape, side: int, tail: int = 0) -> tuple:
    return (shape[0] + tail, shape[1] + side) if side or tail else tuple(shape)


def _view(buffer: torch.Tensor, start: int, shape, dtype: torch.dtype, side: int = 0,
          tail: int = 0) -> torch.Tensor:
    laid = _laid(shape, side, tail)
    nbytes = _numel(laid) * torch.empty((), dtype=dtype).element_size()
    view = buffer[start:start + nbytes].view(dtype).view(laid)
    return view[:shape[0], :shape[1]] if side or tail else view


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


# ====================================================================== split masters
def split_master(value: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor) -> None:
    """Write fp32 `value` as its halves: `hi` (bf16) its top 16 bits rounded half away
    from zero (adding one to them carries into the exponent as rounding does), `lo`
    (int16) the rest: its low 16 bits read as a signed number, which is what rounding
    took off (16 bits >= 0x8000, which round up, read as their value minus 2^16), so
    bits(value) = bits(hi) * 2^16 + lo. Works on the int16 halves of each fp32
    (little-endian: low half first), so it needs 3 bytes an element besides `value`."""
    halves = _halves(value.detach().to(hi.device, torch.float32).contiguous())
    lo.view(-1).copy_(halves[:, 0])
    torch.add(halves[:, 1], halves[:, 0] < 0, out=hi.view(torch.int16).view(-1))


def joined_master(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """The fp32 value of a split master (a new tensor): bits(hi) * 2^16 + lo, that is low
    half lo and top half hi, less one where lo is negative (lo >> 15 is -1 there, else 0)."""
    value = torch.empty(hi.shape, dtype=torch.float32, device=hi.device)
    halves = _halves(value)
    halves[:, 0] = lo.reshape(-1)
    torch.add(hi.view(torch.int16).reshape(-1), lo.reshape(-1) >> 15, out=halves[:, 1])
    return value


def _halves(value: torch.Tensor) -> torch.Tensor:
    """fp32 `value` as [numel, 2] int16: each element's low and top 16 bits."""
    return value.view(torch.int16).view(-1, 2)


class SplitMasters(Mapping):
    """The fp32 masters of split parameters by path, joined on each lookup (one at a
    time: a checkpoint writes them without holding every fp32 copy at once), on `device`
    (None: where the halves are). `whole`: the parameters stored in fp32 (`@dtype(fp32)`),
    whose compute copy is their master: a copy of it on each lookup."""

    def __init__(self, compute: dict, lows: dict, device=None, whole: dict | None = None):
        self.compute, self.lows, self.device = compute, lows, device
        self.whole = whole or {}

    def on(self, device) -> "SplitMasters":
        """The same masters joined on `device` (the halves are copied there first: "cpu"
        joins a checkpoint's masters without GPU memory)."""
        return SplitMasters(self.compute, self.lows, device, self.whole)

    def __getitem__(self, path: str) -> torch.Tensor:
        if path in self.whole:
            master = self.whole[path]
            return master.to(self.device or master.device, torch.float32, copy=True)
        hi, lo = self.compute[path], self.lows[path]
        if self.device is not None:
            hi, lo = hi.to(self.device), lo.to(self.device)
        return joined_master(hi, lo)

    def __iter__(self):
        yield from self.lows
        yield from self.whole

    def __len__(self) -> int:
        return len(self.lows) + len(self.whole)


def random_params(shapes: dict, seed: int = 0, std: float = 0.02, on: str = "cuda"
                  ) -> dict[str, torch.Tensor]:
    """normal(0, std) fp32 values by path, norm weights (1-d `...weight`) near 1; LoRA
    adapters as PEFT (and Model.init_random) make them (runtime.lora.adapter_value: B = 0,
    the adapted model starts as the base model), drawn after the base weights, which are
    the same as without LoRA."""
    from modulec.lower.lora import is_adapter
    from runtime.lora import adapter_value

    generator = torch.Generator(device=on).manual_seed(seed)
    params = {}
    for path, shape in shapes.items():
        if is_adapter(path):
            continue
        value = torch.randn(shape, generator=generator, device=on) * std
        params[path] = value + 1.0 if len(shape) == 1 and path.endswith("weight") else value
    for path, shape in shapes.items():
        if is_adapter(path):
            params[path] = adapter_value(path, shape, generator, torch.float32, on)
    return params
