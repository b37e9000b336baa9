"""Running on the memory plan: each activation region is one buffer, every value a view at
its planned offset (issue 5 item 1; the plan is modulec.plan.from_graph's, the layout
modulec.lower.layout's).

Addresses: a function's transient values sit at its frame's base plus their planned
offset; a call's callee frame starts where the caller's plan reserved it (`call:<node>`).
A callee's results the plan hands over (`StepPlan.handed`) are written where the caller's
plan put the call's outputs (a frame's `destinations`), by a repeated call alternately into
the output and its second buffer (`call:<node>:turn<k>`), the last repetition into the
output.
Saved values of the i-th run of forward function F sit in F's record i of the saved region
(`saved_records`): each record holds the storages that run keeps, packed in the plan's
order, so a run whose values the planner decided to recompute or swap (the layout's
`decisions`) takes no bytes for them; such a value lives outside the arena until it is
released. Made by a kernel that writes into given bytes, in the forward or again in the
backward, it goes to the records of its function's later runs (`replay_bytes`): not
written yet in the forward, their backward done in the backward; other such values and
swaps' copies back live outside the arena, as do the saved values of ops whose kernels
allocate their outputs where the arena is made with them (`own_bytes`, the GPU step's:
`own_saved`). A kernel computes out of place and its result is copied into the planned
bytes (an in-place decision shares the input's bytes, which is dead by then); a view op
(view, transpose, permute, split) keeps torch's view of its source, which is in the arena
already. A plan that lets two live values share bytes therefore changes the results,
which is what the arena tests look for.

A buffer the plan lays with spare columns after each row (modulec.plan.pads: a LoRA'd
projection's input) is a strided view of its bytes, as kernels get it to write into
(`out_bytes`) and as the value is placed; `pad_of` tells a runtime the spare columns.

Sizes are the plan's, computed from the IR dtypes (bf16 activations, fp32 statistics): an
arena run uses those dtypes (`dtype=torch.bfloat16`); a value that does not fit its
planned bytes is an error, never a silent overrun.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from modulec.plan.from_graph import ALIASES, plan_step, shared_twins, turn_of, unnamed_of
from modulec.plan.in_place import IN_PLACE_OUTPUTS, in_place_nodes
from modulec.plan.memory import GRADIENTS, SAVED, TRANSIENT, WEIGHTS
from modulec.plan.memory.model import round_up
from runtime.errors import RuntimeUserError
from runtime.kernels.utility import TORCH_DTYPES

# the IR's dtypes as an arena run holds them ("float": the compute dtype, bf16 there)
IR_DTYPES = TORCH_DTYPES | {"float": torch.bfloat16}


@dataclass
class Arena:
    graph: object
    layout: dict  # the `layout` of the document's schedule
    device: str = "cpu"
    regions: dict[str, Tensor] = field(default_factory=dict)
    placements: dict = field(default_factory=dict)
    records: dict = field(default_factory=dict)  # forward function -> per run: its record
    handed: dict = field(default_factory=dict)  # function -> {result: position}
    twins: dict = field(default_factory=dict)  # function -> {position: its source's}
    joins: dict = field(default_factory=dict)  # function -> {part: modulec.plan.joins.Part}
    pads: dict = field(default_factory=dict)  # function -> {value: modulec.plan.pads.Pad}
    # NaN over the transient bytes after the forward and over released values (tests)
    poison: bool = True
    ends: dict = field(default_factory=dict)  # forward function -> end of its last record
    rows: dict = field(default_factory=dict)  # (function, value) -> its layout row
    _replays: dict = field(default_factory=dict)  # (id(run), value) -> bytes this step
    _cursor: dict = field(default_factory=dict)  # forward function -> (run, next free byte)
    _in_place: dict = field(default_factory=dict)  # function -> its in-place node ids
    # ops whose kernels allocate their outputs (no `out=`: `allocates_outputs`, the GPU
    # step's grouped GEMM, attention, MoE gathers): a saved value such an op makes keeps
    # the kernel's bytes, and records hold no bytes for it (`own_saved`)
    own_bytes: frozenset = frozenset()
    own: dict = field(default_factory=dict)  # forward function -> its values of own bytes
    # a concat of parameters that came out as a view of them stays that view
    # (`_joined_parameters`): for a caller whose parameters stay put through a step's
    # forward and backward (the GPU step's weights region; not ZeRO's gathered copies)
    parameter_views: bool = False

    def __post_init__(self):
        plan = plan_step(self.graph)
        self.placements = plan.placements
        self.handed = plan.handed
        self.twins = plan.twins
        self.joins = plan.joins
        self.pads = plan.pads
        self.regions = {TRANSIENT: torch.empty(plan.regions[TRANSIENT].arena,
                                               dtype=torch.uint8, device=self.device)}
        self.own = own_saved(self.graph, self.placements, self.handed, self.own_bytes)
        self.records, self.ends = saved_records(self.layout, self.placements, self.own)
        self.rows = {(f["function"], row["value"]): row
                     for f in self.layout.get("functions", []) for row in f["values"]}
        self.regions[SAVED] = torch.empty(max(self.ends.values(), default=0),
                                          dtype=torch.uint8, device=self.device)

    def bytes_of(self) -> dict[str, int]:
        return {name: region.numel() for name, region in self.regions.items()}

    # ------------------------------------------------------------------ frames
    def enter(self, frame, parent=None, node=None, remaining: int = 0) -> None:
        """Give `frame` its transient base (its saved record is its `instance`) and the
        caller's bytes of the results it hands over (`remaining`: the call's repetitions
        after this one)."""
        if parent is None:  # the forward or the backward begins: spare bytes afresh
            self._replays, self._cursor = {}, {}
            return
        reserved = self.placements.get(parent.function.name, {}).get(f"call:{node.id}")
        frame.transient_base = parent.transient_base + (reserved.offset if reserved else 0)
        frame.destinations = {
            value: where for value, k in self.handed.get(frame.function.name, {}).items()
            if (where := self._result_bytes(parent, node, k, remaining)) is not None}

    def replay_bytes(self, frame, value: str) -> Tensor | None:
        """Bytes (uint8) for saved `value` of forward run i that run i's record does not
        keep: the next free ones in the records of the function's runs after i, or None
        where none are left. In the forward those records are not written yet (the value
        is released when run i returns); in the backward their runs' backward is done."""
        key = (id(frame), value)
        if key in self._replays:
            return self._replays[key]
        name, placement = frame.function.name, self.placements.get(
            frame.function.name, {}).get(value)
        runs = self.records.get(name, [])
        if placement is None or placement.region != SAVED or placement.block != value or \
                self._start(frame, placement) is not None or frame.instance + 1 >= len(runs) \
                or _kind(self.rows.get((name, value), {}), frame.instance) == "swap":
            return None  # a swapped one is copied out on a side stream after its release
        run, free = self._cursor.get(name, (None, 0))
        if run != frame.instance:
            free = runs[frame.instance + 1][0]
        at = round_up(free, ALIGNMENT)
        if at + placement.size_bytes > self.ends[name]:
            return None
        self._cursor[name] = (frame.instance, at + placement.size_bytes)
        self._replays[key] = self.regions[SAVED][at:at + placement.size_bytes]
        return self._replays[key]

    def hand_over(self, parent, node, child, values: list, remaining: int) -> list:
        """A call's results after one repetition, in the caller's bytes for them (copied
        there unless the callee wrote them there); a result the callee saves stays in its
        record while repetitions remain (the next one reads it there)."""
        handed = []
        for k, (value, tensor) in enumerate(zip(child.function.outputs, values)):
            if not value or not isinstance(tensor, Tensor) or \
                    (remaining and self.is_saved(child, value)):
                handed.append(tensor)
                continue
            where = self._result_bytes(parent, node, k, remaining)
            handed.append(self._into(where[1], tensor) if where is not None else
                          tensor.clone() if self._in_arena(tensor) else tensor)
        return handed

    def _result_bytes(self, parent, node, k: int, remaining: int):
        """(region, bytes) the caller holds for result `k` of call `node` in the
        repetition with `remaining` after it, or None. A twin result the call names with
        its source is in the source's bytes (`StepPlan.twins`)."""
        k = shared_twins(node, self.twins).get(k, k)
        key = turn_of(node.id, k) if remaining % 2 else node.outputs[k] or unnamed_of(node.id, k)
        if key in parent.destinations:
            return parent.destinations[key]
        placement = self.placements.get(parent.function.name, {}).get(key)
        if placement is None or placement.block != key:
            return None
        raw = self._planned_bytes(parent, placement)
        return None if raw is None else (placement.region, raw)

    def _planned_bytes(self, frame, placement) -> Tensor | None:
        """The placement's bytes (uint8) in this run, or None where its saved record does
        not keep them."""
        start = self._start(frame, placement)
        if start is None:
            return None
        return self.regions[placement.region][start:start + placement.size_bytes]

    def widen(self, frame, concat: str, raw: Tensor, row: int, pad: int) -> Tensor | None:
        """For this run, concat `concat` planned in place and its parts live in `raw`
        (uint8, the caller's), each `row` elements of it (its trailing dims) `pad`
        elements apart (a kernel writes the spare columns: the LoRA step's one-GEMM d_x,
        runtime/cuda/lora_kcat.py); its typed view, or None (nothing changed) where it is
        not such a concat, its rows are not `row` wide or `raw` is too small."""
        info = frame.function.value(concat)
        dtype = IR_DTYPES.get(info.dtype) if info is not None else None
        if dtype is None or concat not in {p.concat for p in self.joins.get(
                frame.function.name, {}).values()}:
            return None
        shape = tuple(int(d) for d in info.shape)
        rows_end = any(math.prod(shape[i:]) == row for i in range(len(shape)))
        if not rows_end or raw.numel() < math.prod(shape) // row * (row + pad) * dtype.itemsize:
            return None
        frame.widened[concat] = (raw, row, pad)  # this run's alone: it goes with the frame
        return self._widened_view(frame, concat)

    def is_widened(self, frame, concat: str) -> bool:
        return concat in frame.widened

    def _widened_view(self, frame, concat: str) -> Tensor | None:
        kept = frame.widened.get(concat)
        if kept is None:
            return None
        info = frame.function.value(concat)
        shape = tuple(int(d) for d in info.shape)
        return padded_view(kept[0], IR_DTYPES[info.dtype], shape, kept[1], kept[2])

    def _part(self, frame, value: str) -> Tensor | None:
        """A part of a concat planned in place (modulec.plan.joins): its slice of the
        concat's planned bytes (or of its widened rows: `widen`), typed (strided on an
        inner dim), or None."""
        part = self.joins.get(frame.function.name, {}).get(value)
        if part is None:
            return None
        info = frame.function.value(part.concat)
        dtype = IR_DTYPES.get(info.dtype)
        placement = self.placements[frame.function.name][part.concat]
        if dtype is None or placement.block != part.concat:
            return None
        shape = tuple(int(d) for d in info.shape)
        wide = self._widened_view(frame, part.concat)
        whole = wide if wide is not None else self._planned_bytes(frame, placement)
        if whole is None:
            return None
        typed = wide if wide is not None else whole.view(dtype).view(shape)
        view = typed.narrow(part.dim, part.start, part.length)
        for dim0, dim1 in part.swaps:
            view = view.transpose(dim0, dim1)
        return view

    def pad_of(self, frame, value: str) -> int:
        """The spare elements after each row of `value` the plan lays (0: none); a
        caller still checks the tensor's strides (a kernel or a replay may have handed a
        dense copy)."""
        pad = self.pads.get(frame.function.name, {}).get(value)
        return pad.pad if pad is not None else 0

    def _wide(self, frame, value: str, placement, shape, dtype) -> Tensor | None:
        """`value`'s bytes as its strided view where the plan lays its rows wide, else
        None."""
        pad = self.pads.get(frame.function.name, {}).get(value)
        raw = self._planned_bytes(frame, placement) \
            if pad is not None and placement.block == value else None
        return None if raw is None else padded_view(raw, dtype, tuple(shape), pad.row, pad.pad)

    def _into(self, where: Tensor, tensor: Tensor) -> Tensor:
        """`tensor` in bytes `where` (copied unless it is there already)."""
        if tensor.nbytes > where.numel():
            raise RuntimeUserError(f"a call's result needs {tensor.nbytes} bytes, the plan "
                                   f"gives it {where.numel()}")
        return _moved(_typed(where[:tensor.nbytes], tensor), tensor)

    def is_transient(self, frame, value: str) -> bool:
        if value in frame.destinations:
            return frame.destinations[value][0] == TRANSIENT
        placement = self.placements.get(frame.function.name, {}).get(value)
        return placement is not None and placement.region == TRANSIENT

    def poison_transient(self) -> None:
        """NaN over the transient bytes between forward and backward: nothing the
        backward reads may come from there."""
        self.regions[TRANSIENT].fill_(255)

    def in_transient(self, tensor) -> bool:
        """`tensor` lies in the transient region's bytes (whatever value it stands for)."""
        if not isinstance(tensor, Tensor) or tensor.device != self.regions[TRANSIENT].device:
            return False
        region = self.regions[TRANSIENT]
        start = region.data_ptr()
        return start <= tensor.data_ptr() < start + region.numel()

    def may_keep(self, frame, value: str) -> bool:
        """`value` may live outside the arena: transient, in bytes of its own frame (not a
        result its caller's bytes hold, not a part of a concat planned in place)."""
        if value in frame.destinations or value in self.joins.get(frame.function.name, {}):
            return False
        placement = self.placements.get(frame.function.name, {}).get(value)
        return placement is not None and placement.region == TRANSIENT

    def is_saved(self, frame, value: str) -> bool:
        """`value` of this run has bytes in its saved record (the run keeps it)."""
        placement = self.placements.get(frame.function.name, {}).get(value)
        return placement is not None and placement.region == SAVED and \
            self._start(frame, placement) is not None

    def place(self, frame, node, value: str, tensor: Tensor) -> Tensor:
        """The value's tensor in its planned bytes (views stay torch views)."""
        if value in frame.destinations and isinstance(tensor, Tensor):
            return self._into(frame.destinations[value][1], tensor)
        if (id(frame), value) in self._replays and isinstance(tensor, Tensor):
            return self._into(self._replays[(id(frame), value)], tensor)
        part = self._part(frame, value)
        if part is not None and isinstance(tensor, Tensor):
            return _moved(part, tensor)
        wide = self._widened_view(frame, value)
        if wide is not None and isinstance(tensor, Tensor):
            return _moved(wide, tensor)
        placement = self.placements.get(frame.function.name, {}).get(value)
        if placement is None and self._in_arena(tensor):
            return tensor.clone()  # no planned bytes (a parameter's gradient): its own
        if placement is None or not isinstance(tensor, Tensor) or \
                (node is not None and node.kind == "op" and node.target in ALIASES):
            return tensor
        if self.parameter_views and _joined_parameters(node, tensor) \
                and not self._in_arena(tensor):
            return tensor
        target = self._in_place_target(frame, node, value)
        if target is None:
            target = self._view(frame, placement, tensor, value)
        if target is None:  # no bytes in this run's record: the run does not keep it
            return tensor
        return _moved(target, tensor)  # nothing moves where it is there (layouts' views)

    def out_bytes(self, frame, node, value: str) -> Tensor | None:
        """The planned bytes (uint8) a kernel may write `value` into, or None: no
        placement, or bytes that are another value's (a view, an in-place output)."""
        if value in frame.destinations:
            return frame.destinations[value][1]
        wide = self._widened_view(frame, value)
        if wide is not None:
            return wide
        part = self._part(frame, value)
        if part is not None:
            return part
        placement = self.placements.get(frame.function.name, {}).get(value)
        if placement is None or placement.block != value or node.target in ALIASES or \
                self._in_place_target(frame, node, value) is not None:
            return None
        info = frame.function.value(value)
        dtype = IR_DTYPES.get(info.dtype) if info is not None else None
        wide = self._wide(frame, value, placement, info.shape, dtype) if dtype else None
        if wide is not None:  # typed, strided: a kernel writes rows there or allocates
            return wide
        raw = self._planned_bytes(frame, placement)
        # None: a saved value this run does not keep: spare bytes
        return raw if raw is not None else self.replay_bytes(frame, value)

    def _in_arena(self, tensor) -> bool:
        """A view of the activation regions' bytes (a kernel that returns a view of its
        input, as the training kernels' view_backward does)."""
        if not isinstance(tensor, Tensor):
            return False
        storage = tensor.untyped_storage().data_ptr()
        return any(storage == r.untyped_storage().data_ptr() for r in self.regions.values())

    def _in_place_target(self, frame, node, value: str) -> Tensor | None:
        """An output the plan writes over its input (modulec.plan.in_place): the input's
        tensor itself. Its planned bytes are the input's, which a split part on an inner
        dim holds strided, not as the dense range its placement reads as."""
        if node is None or node.kind != "op" or node.target not in IN_PLACE_OUTPUTS:
            return None
        name = frame.function.name
        if name not in self._in_place:
            self._in_place[name] = in_place_nodes(self.graph, frame.function)
        if node.id not in self._in_place[name]:
            return None
        for output, source in IN_PLACE_OUTPUTS[node.target]:
            if node.outputs[output] == value:
                return frame.env.get(node.inputs[source])
        return None

    def _view(self, frame, placement, tensor: Tensor, value: str) -> Tensor:
        wide = self._wide(frame, value, placement, tensor.shape, tensor.dtype)
        if wide is not None:
            return wide
        if tensor.nbytes > placement.size_bytes:
            raise RuntimeUserError(
                f"`{value}` of `{frame.function.name}` needs {tensor.nbytes} bytes, the plan "
                f"gives it {placement.size_bytes}", help=["run on the plan in the IR's "
                                                          "dtypes (dtype=torch.bfloat16)"])
        raw = self._planned_bytes(frame, placement)
        return None if raw is None else _typed(raw[:tensor.nbytes], tensor)

    def _start(self, frame, placement) -> int | None:
        """Where the placement's bytes start in its region; None for a saved value this
        run does not keep."""
        if placement.region == TRANSIENT:
            return frame.transient_base + placement.offset
        base, blocks = self.records[frame.function.name][frame.instance]
        if placement.block not in blocks:
            return None
        block = self.placements[frame.function.name][placement.block]
        return base + blocks[placement.block] + placement.offset - block.offset


def own_saved(graph, placements: dict, handed: dict, targets) -> dict[str, frozenset]:
    """{forward function: the saved storages (values no other value's view) made by an op
    in `targets` (kernels that allocate their outputs), none of them a result the caller's
    bytes hold}. Such a value stays in the bytes its kernel made: copying it into its
    record would move every byte once more (the grouped GEMM's gate/up product of a
    Mixtral-shaped layer: 352 MiB read and written), and the saved region shrinks by what
    the allocator holds instead, so the step's bytes are the plan's either way."""
    own = {}
    for function in graph.functions if targets else ():
        placed, results = placements.get(function.name, {}), handed.get(function.name, {})
        values = frozenset(
            value for node in function.nodes if node.kind == "op" and node.target in targets
            for value in node.outputs
            if value and value not in results and (p := placed.get(value)) is not None
            and p.region == SAVED and p.block == value)
        if values and not function.gradient_of:
            own[function.name] = values
    return own


def saved_records(layout: dict, placements: dict, own: dict | None = None
                  ) -> tuple[dict, dict]:
    """({forward function: per run, (base, {storage: offset in the record})}, {forward
    function: where its last record ends}; the last end is the saved region's bytes). A
    run's record holds the storages (a value and its views) it keeps (the layout's
    decisions; none: keep), in the plan's order, aligned, but those of `own` (own_saved:
    they keep their kernel's bytes)."""
    records, ends, end = {}, {}, 0
    for entry in layout.get("functions", []):
        name, runs = entry["function"], []
        skip = (own or {}).get(name, frozenset())
        order = sorted((p.offset, value) for value, p in placements.get(name, {}).items()
                       if p.region == SAVED and p.block == value and value not in skip)
        for instance in range(entry["instances"]):
            kept = {row.get("view_of", row["value"]) for row in entry["values"]
                    if _kind(row, instance) == "keep"}
            blocks, size = {}, 0
            for _, block in order:
                if block in kept:
                    blocks[block] = size
                    size += round_up(placements[name][block].size_bytes, ALIGNMENT)
            runs.append((end, blocks))
            end += size
        records[name], ends[name] = runs, end
    return records, ends


def _kind(row: dict, instance: int) -> str:
    """A layout row's decision for `instance`: keep, recompute or swap."""
    return next((k for k, first, last in row.get("decisions", ()) if first <= instance <= last),
                "keep")


def _moved(target: Tensor, tensor: Tensor) -> Tensor:
    """`target` holding `tensor`'s values (copied unless `tensor` is `target` already)."""
    if target.shape != tensor.shape or target.dtype != tensor.dtype:
        raise RuntimeUserError(f"a {list(tensor.shape)} {tensor.dtype} value for planned "
                               f"bytes of {list(target.shape)} {target.dtype}",
                               help=["run on the plan in the IR's dtypes "
                                     "(dtype=torch.bfloat16)"])
    copy_in_16_bytes(target, tensor)
    return target


def copy_in_16_bytes(into: Tensor, source: Tensor) -> None:
    """into.copy_(source), on the GPU in 16-byte elements where both lay their last dim
    contiguous and every other stride, the last dim's size and the offset in multiples of
    16 bytes: torch copies a strided view one element a thread, 2 bytes for bf16 (a
    concat's part planned in place, d_v's [B, Hkv, T, D] into d_qkv's head slots: 6.2 us
    a layer in the LoRA 8B replay, for 4 MB). The same bits either way. Nothing is moved
    where `source` is `into` already (a kernel wrote it there)."""
    if into.data_ptr() == source.data_ptr() and into.stride() == source.stride():
        return
    wide = 16 // source.element_size() if source.element_size() in (2, 4, 8) else 0
    if wide and into.is_cuda and into.dtype == source.dtype and into.shape == source.shape \
            and all(_in_pieces(t, wide) for t in (into, source)):
        into, source = into.view(torch.complex128), source.view(torch.complex128)
    into.copy_(source)


def _in_pieces(t: Tensor, wide: int) -> bool:
    return t.dim() > 0 and t.stride(-1) == 1 and t.shape[-1] % wide == 0 \
        and t.storage_offset() % wide == 0 and all(s % wide == 0 for s in t.stride()[:-1])


def padded_view(raw: Tensor, dtype, shape: tuple, row: int, pad: int) -> Tensor:
    """Bytes `raw` (uint8) as a `shape` tensor of `dtype` whose rows of `row` elements
    (its trailing dims) lie `row + pad` apart (modulec.plan.pads)."""
    dims = [int(d) for d in shape]
    strides, step, k = [0] * len(dims), 1, len(dims)
    while k > 0 and step * dims[k - 1] <= row:  # the row: contiguous
        k -= 1
        strides[k], step = step, step * dims[k]
    step = row + pad
    for i in range(k - 1, -1, -1):  # rows, wide apart
        strides[i], step = step, step * dims[i]
    typed = raw.view(dtype)
    return typed.as_strided(dims, strides, typed.storage_offset())


def _typed(raw: Tensor, tensor: Tensor) -> Tensor:
    """Bytes `raw` (uint8, `tensor.nbytes` of them) as a tensor like `tensor`."""
    raw = raw.view(tensor.dtype)
    if not tensor.is_contiguous() and _dense(tensor):  # keep its memory order
        return raw.as_strided(tensor.shape, tensor.stride())
    return raw.view(tensor.shape)


def _dense(tensor: Tensor) -> bool:
    """Its elements fill numel() slots with no gap or overlap (a permuted contiguous
    tensor), so its strides fit a buffer of its own size."""
    expected = 1
    for size, stride in sorted(zip(tensor.shape, tensor.stride()), key=lambda d: d[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


# ====================================================================== parameters
ALIGNMENT = 256


@dataclass
class ParameterRegions:
    """The weights and gradients regions: one buffer each, every parameter (and its
    gradient) a view at the same offset in its region, in path order."""

    offsets: dict[str, tuple[int, int]]  # path -> (offset, bytes)
    weights: Tensor
    gradients: Tensor

    @classmethod
    def for_params(cls, params: dict, device="cpu") -> "ParameterRegions":
        offsets, end = {}, 0
        for path in sorted(params):
            offsets[path] = (end, params[path].nbytes)
            end += round_up(params[path].nbytes, ALIGNMENT)
        make = lambda: torch.zeros(end, dtype=torch.uint8, device=device)  # noqa: E731
        return cls(offsets, make(), make())

    def bind(self, params: dict) -> dict:
        """The parameters copied into the weights region, as views there."""
        return {path: self._copy(self.weights, path, tensor) for path, tensor in params.items()}

    def gradient(self, path: str, tensor: Tensor) -> Tensor:
        """A parameter's gradient, summed into its place in the gradients region."""
        view = self._view(self.gradients, path, tensor)
        view.add_(tensor) if path in self._written else view.copy_(tensor)
        self._written.add(path)
        return view

    def start_backward(self) -> None:
        self._written = set()

    def _copy(self, region: Tensor, path: str, tensor: Tensor) -> Tensor:
        view = self._view(region, path, tensor)
        view.copy_(tensor)
        return view

    def _view(self, region: Tensor, path: str, tensor: Tensor) -> Tensor:
        if path not in self.offsets:
            raise RuntimeUserError(f"parameter `{path}` has no place in the weights region")
        offset, size = self.offsets[path]
        if tensor.nbytes != size:
            raise RuntimeUserError(f"`{path}` has {tensor.nbytes} bytes, its region slot "
                                   f"{size}")
        return region[offset:offset + size].view(tensor.dtype).view(tensor.shape)

    def bytes_of(self) -> dict[str, int]:
        return {WEIGHTS: self.weights.numel(), GRADIENTS: self.gradients.numel()}


def _joined_parameters(node, tensor: Tensor) -> bool:
    """A concat of parameters that came out as a view of them (they lie side by side:
    LoRA's stacked A, runtime/cuda/state.py `stacked_order`): it stays that view, where a
    copy into its planned bytes would be the very copy the layout saves. Where the arena
    is made with `parameter_views`, the parameters stay put through a step's forward and
    backward, so the view reads what a copy would hold."""
    return node is not None and node.kind == "op" and node.target == "concat" \
        and tensor._base is not None and all(v.startswith("param:") for v in node.inputs)
