"""Data parallel with ZeRO sharding, executed from the Schedule IR's `distributed` section
(modulec/plan/distributed.py says what the section holds and what each stage keeps).

`ZeroRun` owns the trained parameters' state per bucket instance (a layer, or one entry
parameter), laid out flat as the section says: the compute weights (whole, or with
ZeRO-3 a shard plus two gather slots per repeated bucket; an entry bucket's whole
weights in a buffer made and dropped by the section's `allocate` / `release`), this
rank's shard of the master and the AdamW moments, and the gradient slots (a
reduce_scatter leaves the rank's sum in its own part of the slot). The training step
calls it at the section's triggers:

    run.step_begin()                      # before the forward
    run.frame_begin(path, backward)       # a layer's or the entry's function run starts
    run.gradient(path, grad)              # a final gradient; a complete bucket reduces,
                                          # updates its shard and gathers the weights
    run.step_end()                        # the compute stream waits for the collectives

and each trigger runs the section's ops for it, in order, on their streams. The same code
runs on CUDA with NCCL (the split bf16/int16 masters and the fused AdamW kernel) and on
the CPU with gloo (fp32 masters, torch's AdamW arithmetic): `Precision` says which.

The run also computes the global gradient norm (`grad_norm`, a device scalar): each
rank adds the squares of the reduced gradient part it updates, and at `step_end` one
all_reduce of that one-element sum (ZeRO 1-3; with ZeRO-0 every rank has every reduced
gradient) makes the norm. With global clipping (`clip`) the section's `adamw_shard` and
its `all_gather` of `gradients_ready` are deferred to `step_end`: each bucket instance's
reduced gradient part is kept (`held`, the shard's size per instance), and once the norm
is known every instance is updated with the factor min(1, clip / (norm + 1e-6)) and
gathered, in the order the section issued them (docs/decisions.md, "Training
optimizer"). Weight decay is per parameter (`decay_of(path)`, the factor of the base
decay): the update of a shard runs once per run of parameters with one factor.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from modulec.ir.graph import COMM_STREAM as COMM  # the communication stream
from runtime.dist.ce_gather import copy_engine_gather
from runtime.dist.collectives import all_gather_into, all_reduce_, reduce_scatter_into
from runtime.errors import RuntimeUserError


@dataclass(frozen=True)
class Precision:
    """How a rank holds the state: `split` (the GPU) keeps the fp32 master as the bf16
    compute copy plus an int16 low half (runtime/cuda/state.py); otherwise the compute
    copy is the fp32 master. `update(hi, lo, grad, m, v, decay, scale)` is one AdamW step
    on flat tensors (lo None when not split) with `decay` times the base weight decay
    and the gradient multiplied by `scale` (a device scalar; None: 1)."""

    compute: torch.dtype
    gradient: torch.dtype
    split: bool
    update: Callable

    @property
    def master(self) -> torch.dtype:
        """The master's and the moments' dtype: fp32 when split, else the compute dtype
        (the CPU's float32 or float64)."""
        return torch.float32 if self.split else self.compute


@dataclass
class Bucket:
    spec: dict
    sharded: bool  # ZeRO-3: the rank keeps the shard of the compute weights alone
    layered: bool  # ZeRO-3 and a repeated layer: the whole weights gathered into slots
    weights: list = field(default_factory=list)  # per instance: the whole flat compute copy
    hi: list = field(default_factory=list)  # per instance: this rank's part of the master
    lo: list = field(default_factory=list)  # per instance: its low half (split) or None
    exp_avg: list = field(default_factory=list)
    exp_avg_sq: list = field(default_factory=list)
    grad_slots: list = field(default_factory=list)  # min(2, instances) whole flat gradients
                                                    # (or a view of a shared slot)
    slots: list = field(default_factory=list)  # ZeRO-3: two whole flat weight slots
    buffer: Tensor | None = None  # ZeRO-3, an entry bucket: its whole weights while held
    absent: dict = field(default_factory=dict)  # ... and what its paths read meanwhile
                                                # (meta tensors)
    held: list = field(default_factory=list)  # with clipping: per instance, its reduced part
    gaps: list = field(default_factory=list)  # a shared slot: (start, stop) no parameter
                                              # covers, zeroed at each copy in
    segments: list = field(default_factory=list)  # (start, stop, decay factor) of its part

    @property
    def name(self) -> str:
        return self.spec["name"]

    @property
    def count(self) -> int:
        return self.spec["instances"]

    def key(self, instance: int) -> str:
        from modulec.plan.distributed import bucket_key

        return bucket_key(self.spec, instance)

    def whole(self, instance: int) -> Tensor | None:
        """The flat compute weights instance `instance` reads (None: an entry bucket's
        buffer, not held now)."""
        if self.layered:
            return self.slots[instance % 2]
        return self.buffer if self.sharded else self.weights[instance]


class ZeroRun:
    def __init__(self, section: dict, rank: int, precision: Precision, device: str,
                 streams, group=None, decay_of: Callable | None = None,
                 clip: float | None = None, sharded=None, tp_group=None):
        """`decay_of(path)`: the factor of the base weight decay a parameter gets (None:
        1 for all); `clip`: global gradient-norm clipping's largest norm (None: off);
        `sharded`: under tensor parallel, the paths this rank holds a slice of (the
        norm sums their squares over `tp_group`: runtime/dist/tp_norm.py)."""
        self.section, self.rank, self.precision, self.device = section, rank, precision, device
        self.decay_of, self.clip = decay_of or (lambda path: 1.0), clip
        # the squares' sum, then the norm: [1] tensors (a collective's buffer), in the
        # masters' dtype (fp32 on the GPU, the CPU run's float32 or float64)
        # (under TP a second element: the slices' squares, summed over the TP group)
        self.squares = torch.zeros(2 if sharded else 1, dtype=precision.master, device=device)
        self.norm_sq = self.squares[0:1]
        self.sliced_sq = self.squares[1:2] if sharded else None
        self.tp_group = tp_group
        self.grad_norm = torch.zeros(1, dtype=precision.master, device=device)
        # on the GPU (split masters), without TP slices or clipping, the AdamW kernel adds
        # the squares of the part it updates to a fp64 sum: no pass of its own (adamw.cu)
        self.fused_sq = torch.zeros(1, dtype=torch.float64, device=device) \
            if precision.split and not sharded and clip is None else None
        self.deferred: list[tuple] = []
        self.dp, self.zero = section["mesh"]["dp"], section["zero"]
        self.streams, self.group = streams, group
        # where the updated weights' all-gathers run (runtime/dist/ce_gather.py)
        self.ce, self.gather_transport = copy_engine_gather(device, group, self.zero)
        self.buckets = [Bucket(b, self.zero == 3, self.zero == 3 and "{i}" in b["path"])
                        for b in section["buckets"]]
        # entry buckets sharing a gradient slot: its flat tensor by name (the largest
        # user's size), and the bucket instance that copied into it last this step
        self.shared_slots: dict[str, Tensor] = {}
        self.slot_user: dict[str, str] = {}
        self.ops = _ops_by_trigger(section["ops"])
        layers = [(b, i) for b in self.buckets if "{i}" in b.spec["path"]
                  for i in range(b.count)]
        # the first and the last repeated layer of the forward: an entry bucket's `at`
        self.anchors = {layers[0][0].key(layers[0][1]): "first"} if layers else {}
        if layers:
            last = layers[-1][0].key(layers[-1][1])
            self.anchors[last] = "last" if last not in self.anchors else "both"
        self.bound: dict = {}  # the step's compute views by path (attach)
        self.peak_buffer_numel = 0  # the most entry-buffer elements held at once so far
        self.aliases: dict[str, list[str]] = {}  # a path -> the paths tied to it
        # path -> (bucket, instance, offset, numel, shape)
        self.index: dict[str, tuple] = {}
        self.frames: dict[str, tuple] = {}  # "blocks[3]" -> (bucket, instance), layered
        for bucket in self.buckets:
            for i in range(bucket.count):
                prefix = bucket.key(i) if bucket.spec["path"] else ""
                for p in bucket.spec["params"]:
                    path = f"{prefix}.{p['name']}" if prefix else p["name"]
                    self.index[path] = (bucket, i, p["offset"], p["numel"], tuple(p["shape"]))
                if bucket.layered:
                    self.frames[bucket.key(i)] = (bucket, i)
        self.arrived: dict[tuple, dict] = {}
        self.scale = 1.0 / self.dp
        # (bucket, instance) -> this rank's part as runs (start, stop, sliced) (TP only)
        self.runs = {key: self._runs(key, set(sharded)) for key in
                     {(b.name, i) for b, i, *_ in self.index.values()}} if sharded else {}

    @property
    def paths(self) -> set[str]:
        return set(self.index)

    # ------------------------------------------------------------------ state
    def load(self, params: dict) -> dict[str, Tensor]:
        """Take the whole fp32 value of every bucket parameter (the same on every rank);
        returns the compute copies by path, views of the flat weights (ZeRO-3: of the
        slot its layer is gathered into; an entry bucket's are empty until its buffer is
        made: `attach` the dict they go into)."""
        missing = sorted(set(self.index) - set(params))
        if missing:
            raise KeyError(f"no value for {missing[:5]}")
        for bucket in self.buckets:
            self._allocate_state(bucket)
            for i in range(bucket.count):
                self._load_instance(bucket, i, params)
        return self.compute_views()

    def compute_views(self) -> dict[str, Tensor]:
        return {path: self._view(path) for path in self.index}

    def _view(self, path: str) -> Tensor:
        """`path`'s compute weights: a view of its flat whole, or while a ZeRO-3 entry
        bucket's buffer is not held, a tensor of its shape on the meta device (a kernel
        reading it fails; its shape is there for the backward's shape records)."""
        bucket, i, offset, numel, shape = self.index[path]
        whole = bucket.whole(i)
        return bucket.absent[path] if whole is None else \
            whole[offset:offset + numel].view(shape)

    def attach(self, bound: dict, ties: dict[str, str]) -> None:
        """The dict the step reads its compute weights from (a ZeRO-3 entry bucket's views
        are put in and taken out of it as its buffer is made and dropped), and the tied
        paths -> their targets (bound with them)."""
        self.bound, self.aliases = bound, {}
        for path, target in ties.items():
            self.aliases.setdefault(target, []).append(path)
        for bucket in self.buckets:
            if bucket.sharded and not bucket.layered:
                self._bind(bucket)

    def _bind(self, bucket: Bucket) -> None:
        for path in bucket.absent:
            view = self._view(path)
            for name in (path, *self.aliases.get(path, ())):
                self.bound[name] = view

    def _allocate_state(self, bucket: Bucket) -> None:
        n = bucket.spec["numel"]
        prec, kw = self.precision, dict(device=self.device)
        bucket.grad_slots = [self._shared_slot(bucket)[:n]] \
            if "gradient_slot" in bucket.spec else \
            [torch.zeros(n, dtype=prec.gradient, **kw) for _ in range(min(2, bucket.count))]
        bucket.slots = [torch.zeros(n, dtype=prec.compute, **kw) for _ in range(2)] \
            if bucket.layered else []
        bucket.buffer = None
        bucket.absent = {path: torch.empty(shape, dtype=prec.compute, device="meta")
                         for path, (b, _, _, _, shape) in self.index.items() if b is bucket} \
            if bucket.sharded and not bucket.layered else {}
        for name in ("weights", "hi", "lo", "exp_avg", "exp_avg_sq"):
            setattr(bucket, name, [])
        part = self.own(bucket)
        bucket.held = [torch.zeros(part.stop - part.start, dtype=prec.gradient, **kw)
                       for _ in range(bucket.count)] if self.clip is not None else []
        bucket.segments = self._segments(bucket)
        bucket.gaps = _gaps(bucket.spec) if "gradient_slot" in bucket.spec else []

    def _shared_slot(self, bucket: Bucket) -> Tensor:
        """The flat gradient slot `bucket` shares with other entry buckets, made once at
        the size of the largest of them."""
        name = bucket.spec["gradient_slot"]
        if name not in self.shared_slots:
            from modulec.plan.distributed import shared_slot_numels

            numel = shared_slot_numels(self.section)[name]
            self.shared_slots[name] = torch.zeros(numel, dtype=self.precision.gradient,
                                                  device=self.device)
        return self.shared_slots[name]

    def _segments(self, bucket: Bucket) -> list[tuple[int, int, float]]:
        """(start, stop, decay factor) covering this rank's part of the bucket, one per run
        of parameters with one factor (padding joins its neighbour)."""
        part = self.own(bucket)
        cuts = []
        for p in sorted(bucket.spec["params"], key=lambda p: p["offset"]):
            start = max(p["offset"], part.start) - part.start
            stop = min(p["offset"] + p["numel"], part.stop) - part.start
            if start < stop:
                cuts.append((start, stop, float(self.decay_of(self._path(bucket, 0,
                                                                          p["name"])))))
        runs: list[list] = []
        for start, stop, factor in cuts:
            if runs and runs[-1][2] == factor:
                runs[-1][1] = stop
            else:
                if runs:
                    runs[-1][1] = start
                runs.append([start, stop, factor])
        if not runs:
            return [(0, part.stop - part.start, 1.0)]
        runs[0][0], runs[-1][1] = 0, part.stop - part.start
        return [tuple(r) for r in runs]

    def _load_instance(self, bucket: Bucket, i: int, params: dict) -> None:
        n, kw = bucket.spec["numel"], dict(device=self.device)
        flat = torch.zeros(n, dtype=self.precision.master, **kw)
        for p in bucket.spec["params"]:
            path = self._path(bucket, i, p["name"])
            flat[p["offset"]:p["offset"] + p["numel"]].copy_(params[path].reshape(-1))
        part = self.own(bucket)
        if bucket.sharded:  # only the shard stays
            flat = flat[part].clone()
            part = slice(0, bucket.spec["shard"])
        hi, lo = self._held(flat)
        bucket.weights.append(None if bucket.sharded else hi)
        bucket.hi.append(hi[part])
        bucket.lo.append(None if lo is None else lo[part].clone())
        size = bucket.hi[-1].numel()
        bucket.exp_avg.append(torch.zeros(size, dtype=self.precision.master, **kw))
        bucket.exp_avg_sq.append(torch.zeros(size, dtype=self.precision.master, **kw))

    def _held(self, flat: Tensor) -> tuple[Tensor, Tensor | None]:
        """fp32 `flat` as this rank holds it: (compute copy, low half or None); the compute
        copy in the copy-engine gather's window where that runs (ZeRO-1/2: whole weights)."""
        if not self.precision.split:
            return flat, None
        from runtime.cuda.state import split_master

        hi = self.ce.empty(flat.numel(), self.precision.compute, self.device) \
            if self.ce is not None else \
            torch.empty(flat.shape, dtype=self.precision.compute, device=self.device)
        lo = torch.empty(flat.shape, dtype=torch.int16, device=self.device)
        split_master(flat, hi, lo)
        return hi, lo

    def own(self, bucket: Bucket) -> slice:
        """This rank's part of a bucket's flat vector: its shard, or all with ZeRO-0."""
        if self.zero == 0:
            return slice(0, bucket.spec["numel"])
        shard = bucket.spec["shard"]
        return slice(self.rank * shard, (self.rank + 1) * shard)

    def _path(self, bucket: Bucket, i: int, name: str) -> str:
        return f"{bucket.key(i)}.{name}" if bucket.spec["path"] else name

    # ------------------------------------------------------------------ triggers
    def step_begin(self) -> None:
        self.streams.begin_step()
        self.arrived.clear()
        self.deferred.clear()
        self.slot_user.clear()  # the last step's reductions are done (step_end waited)
        self.squares.zero_()  # on the compute stream, before the step's start event
        if self.fused_sq is not None:
            self.fused_sq.zero_()
        for bucket in self.buckets:
            self._run("step_begin", bucket, 0)

    def step_end(self) -> None:
        self._complete_with_zeros()
        with self.streams.on(COMM):
            self._norm_and_deferred()
        for bucket in self.buckets:
            self._run("step_end", bucket, 0)

    def _norm_and_deferred(self) -> None:
        """The global gradient norm from every rank's squares (one all_reduce); with
        clipping, the deferred updates (scaled) and gathers."""
        if self.fused_sq is not None:
            self.norm_sq.add_(self.fused_sq)
        if self.zero >= 1 and self.dp > 1:
            all_reduce_(self.squares, self.group)  # under TP both sums, one collective
        if self.sliced_sq is None:
            torch.sqrt(self.norm_sq, out=self.grad_norm)
        else:
            from runtime.dist.tp_norm import whole_squares

            torch.sqrt(whole_squares(self.norm_sq, self.sliced_sq, self.tp_group),
                       out=self.grad_norm)
        if self.clip is None:
            return
        from runtime.train.param_groups import clip_coefficient

        scale = clip_coefficient(self.grad_norm, self.clip)
        for op, bucket, i in self.deferred:
            if op["kind"] == "adamw_shard":
                self._update_shard(bucket, i, bucket.held[i], scale)
            else:
                self._all_gather(op, bucket, i, deferred=True)
        self.deferred.clear()

    @contextmanager
    def forward_only(self):
        """A forward pass with no backward around it (the evaluation) under ZeRO-3: the
        step's start (layer 0 gathered into its slot) before it, the forward's
        `frame_begin` gathers as in a step, and after it the entry buckets' buffers the
        backward would have released dropped. The state is left as between steps: the
        shards untouched, the slots rewritten by the next step's gathers, no buffer
        held."""
        self.step_begin()
        try:
            yield
        finally:
            for bucket in self.buckets:
                if bucket.sharded and not bucket.layered:
                    with self.streams.on(0):  # the compute stream, as the section's release
                        self._release({}, bucket, 0)

    def frame_begin(self, path: str, backward: bool) -> None:
        """A function run starts at `path`: a repeated layer's forward or backward, or
        the entry's (path ""), which is every entry bucket's; the first and the last
        layer's forward also run the entry buckets' ops `at` them."""
        trigger = "backward_begin" if backward else "forward_begin"
        if path == "":
            for bucket in self.buckets:
                if not bucket.layered:
                    self._run(trigger, bucket, 0)
            return
        hit = self.frames.get(path)
        if hit is not None:
            self._run(trigger, *hit)
        anchor = self.anchors.get(path)
        if anchor is not None and not backward:
            for at in ("first", "last") if anchor == "both" else (anchor,):
                for bucket in self.buckets:
                    if not bucket.layered:
                        self._run(trigger, bucket, 0, at)

    def gradient(self, path: str, grad: Tensor) -> None:
        bucket, i, *_ = self.index[path]
        got = self.arrived.setdefault((bucket.name, i), {})
        if path in got:
            raise RuntimeError(f"{path}: a second gradient in one step")
        got[path] = grad
        if len(got) == len(bucket.spec["params"]):
            self._run("gradients_ready", bucket, i)
            del self.arrived[(bucket.name, i)]

    def _complete_with_zeros(self) -> None:
        """A bucket some of whose parameters got no gradient this step (the same on every
        rank: one graph) is reduced with zeros for them, in bucket order, so that every
        rank issues the same collectives in the same order."""
        for bucket in self.buckets:
            for i in reversed(range(bucket.count)):
                got = self.arrived.get((bucket.name, i))
                if got is None:
                    continue
                for path, (_, _, _, _, shape) in self.index.items():
                    if self.index[path][:2] == (bucket, i) and path not in got:
                        got[path] = torch.zeros(shape, dtype=self.precision.gradient,
                                                device=self.device)
                self._run("gradients_ready", bucket, i)
                del self.arrived[(bucket.name, i)]

    # ------------------------------------------------------------------ ops
    def _run(self, trigger: str, bucket: Bucket, i: int, at: str | None = None) -> None:
        for op in self.ops.get(trigger, ()):
            only, window = op.get("only"), op.get("window")
            if only is not None and (only == "layered") != bucket.layered:
                continue
            if op.get("at") != at or (window is not None and
                                      window not in bucket.spec.get("windows", ())):
                continue
            target = i + op.get("instance", 0)
            if not 0 <= target < bucket.count:
                continue
            kind = op["kind"]
            if op.get("previous") == "gradient_slot":
                self._wait_for_slot(op, bucket, target)
            elif kind == "record_event":
                self.streams.record(op["stream"], f"{op['event']}:{bucket.key(target)}")
            elif kind == "wait_event":
                self.streams.wait(op["stream"], f"{op['event']}:{bucket.key(target)}")
            else:
                with self.streams.on(op["stream"]):
                    OPS[kind](self, op, bucket, target)

    def _wait_for_slot(self, op: dict, bucket: Bucket, i: int) -> None:
        """A shared gradient slot: wait (on the op's stream) for the event `op` names of
        the bucket that copied into it last in this step (none yet: nothing to wait for)."""
        name = bucket.spec.get("gradient_slot")
        last = self.slot_user.get(name) if name is not None else None
        if last is not None and last != bucket.key(i):
            self.streams.wait(op["stream"], f"{op['event']}:{last}")

    def _copy_in(self, op: dict, bucket: Bucket, i: int) -> None:
        """This rank's gradients into the instance's slot, divided by the rank count (the
        sum over ranks is then the mean: each rank's loss is its own batch's mean)."""
        if "gradient_slot" in bucket.spec:
            self.slot_user[bucket.spec["gradient_slot"]] = bucket.key(i)
        slot = bucket.grad_slots[i % len(bucket.grad_slots)]
        for start, stop in bucket.gaps:  # the slot's last user left its values there: the
            slot[start:stop].zero_()     # padding is reduced, and counts in the norm
        for path, grad in self.arrived[(bucket.name, i)].items():
            _, _, offset, numel, shape = self.index[path]
            torch.mul(grad.reshape(shape), self.scale,
                      out=slot[offset:offset + numel].view(shape))

    def _all_reduce(self, op: dict, bucket: Bucket, i: int) -> None:
        all_reduce_(bucket.grad_slots[i % len(bucket.grad_slots)], self.group)

    def _reduce_scatter(self, op: dict, bucket: Bucket, i: int) -> None:
        """In place: the rank's sum into its own part of the slot (NCCL's in-place
        reduce-scatter, output = input + rank * shard; gloo gives the same)."""
        slot = bucket.grad_slots[i % len(bucket.grad_slots)]
        reduce_scatter_into(slot[self.own(bucket)], slot, self.group)

    def _adamw_shard(self, op: dict, bucket: Bucket, i: int) -> None:
        """This rank's part of the reduced gradient: its squares added to the norm, then
        the update (with clipping: the part kept and the update deferred to step_end)."""
        grad = bucket.grad_slots[i % len(bucket.grad_slots)][self.own(bucket)]
        if self.fused_sq is None:  # else the update's kernel adds them
            self._add_squares(bucket, i, grad)
        if self.clip is not None:
            bucket.held[i].copy_(grad)
            self.deferred.append((op, bucket, i))
            return
        self._update_shard(bucket, i, grad, None)

    def _add_squares(self, bucket: Bucket, i: int, grad: Tensor) -> None:
        """The squares of this rank's part into the norm (under TP: a slice's into
        `sliced_sq`, a replicated parameter's into `norm_sq`)."""
        dtype = self.norm_sq.dtype
        if self.sliced_sq is None:
            self.norm_sq.add_(torch.linalg.vector_norm(grad, dtype=dtype).square())
            return
        for start, stop, sliced in self.runs[(bucket.name, i)]:
            target = self.sliced_sq if sliced else self.norm_sq
            target.add_(torch.linalg.vector_norm(grad[start:stop], dtype=dtype).square())

    def _runs(self, key: tuple, sharded: set) -> list[tuple[int, int, bool]]:
        """A bucket instance's parameters within this rank's part, as runs of sliced or
        replicated ones (start, stop relative to the part; padding left out: zeros)."""
        bucket = next(b for b in self.buckets if b.name == key[0])
        part = self.own(bucket)
        rows = sorted((offset, offset + numel, path in sharded) for path, (b, i, offset,
                      numel, _) in self.index.items() if (b.name, i) == key)
        runs: list[list] = []
        for lo, hi, sliced in rows:
            lo, hi = max(lo, part.start) - part.start, min(hi, part.stop) - part.start
            if lo >= hi:
                continue
            if runs and runs[-1][2] == sliced and runs[-1][1] == lo:
                runs[-1][1] = hi
            else:
                runs.append([lo, hi, sliced])
        return [tuple(r) for r in runs]

    def _update_shard(self, bucket: Bucket, i: int, grad: Tensor, scale) -> None:
        """AdamW on instance i's part, a call per run of one weight-decay factor; `scale`
        (a device scalar or None) multiplies the gradient inside the update."""
        lo = bucket.lo[i]
        norm = {} if self.fused_sq is None else {"norm": self.fused_sq}
        for start, stop, decay in bucket.segments:
            part = slice(start, stop)
            self.precision.update(bucket.hi[i][part], None if lo is None else lo[part],
                                  grad[part], bucket.exp_avg[i][part],
                                  bucket.exp_avg_sq[i][part], decay, scale, **norm)

    def _all_gather(self, op: dict, bucket: Bucket, i: int, deferred: bool = False) -> None:
        """The updated shards into the whole weights (in place), or (ZeRO-3) into the slot
        instance i is read from. With clipping, a gather of updated weights waits for
        the deferred update (step_end)."""
        if self.clip is not None and not deferred and op["on"] == "gradients_ready":
            self.deferred.append((op, bucket, i))
            return
        into = op.get("into")
        target = bucket.slots[i % 2] if into == "slot" else \
            bucket.buffer if into == "buffer" else bucket.weights[i]
        # ZeRO-1/2 (the copy-engine gather's stages) gather into the windowed weights
        all_gather_into(target, bucket.hi[i], self.group if self.ce is None else self.ce.group)

    def _allocate(self, op: dict, bucket: Bucket, i: int) -> None:
        """ZeRO-3: an entry bucket's whole buffer, made on the compute stream and bound
        (a gather fills it); a buffer still held (another micro-batch's) is kept."""
        if bucket.buffer is None:
            bucket.buffer = torch.empty(bucket.spec["numel"], dtype=self.precision.compute,
                                        device=self.device)
            self._bind(bucket)
            self.peak_buffer_numel = max(self.peak_buffer_numel, self.buffer_numel())

    def _release(self, op: dict, bucket: Bucket, i: int) -> None:
        """ZeRO-3: drop an entry bucket's buffer once the compute stream is past its last
        read (the allocator reuses its bytes in that stream's order)."""
        if bucket.buffer is not None:
            bucket.buffer = None
            self._bind(bucket)

    # ------------------------------------------------------------------ checkpoints
    def full_state(self, moments: bool = True):
        """(path, fp32 master, exp_avg, exp_avg_sq), each whole and on the CPU, one bucket
        instance at a time: a collective every rank must run (shards are gathered).
        `moments=False`: the masters alone are gathered (the moments are None)."""
        for bucket in self.buckets:
            for i in range(bucket.count):
                master = self._gathered(self._master(bucket, i))
                m, v = (self._gathered(t[i]) for t in (bucket.exp_avg, bucket.exp_avg_sq)) \
                    if moments else (None, None)
                for p in bucket.spec["params"]:
                    part = slice(p["offset"], p["offset"] + p["numel"])
                    yield (self._path(bucket, i, p["name"]),
                           *(t[part].view(tuple(p["shape"])).cpu() if t is not None else None
                             for t in (master, m, v)))

    def _master(self, bucket: Bucket, i: int) -> Tensor:
        if bucket.lo[i] is None:
            return bucket.hi[i]
        from runtime.cuda.state import joined_master

        return joined_master(bucket.hi[i], bucket.lo[i])

    def _gathered(self, part: Tensor) -> Tensor:
        if self.zero == 0 or self.dp == 1:
            return part
        whole = torch.empty(part.numel() * self.dp, dtype=part.dtype, device=part.device)
        all_gather_into(whole, part.contiguous(), self.group)
        return whole

    def load_moments(self, exp_avg: dict, exp_avg_sq: dict) -> None:
        """Whole moments by path (a checkpoint's): each rank keeps its part."""
        for bucket in self.buckets:
            part = self.own(bucket)
            for i in range(bucket.count):
                for source, into in ((exp_avg, bucket.exp_avg[i]),
                                     (exp_avg_sq, bucket.exp_avg_sq[i])):
                    flat = torch.zeros(bucket.spec["numel"], dtype=self.precision.master,
                                       device=self.device)
                    for p in bucket.spec["params"]:
                        value = source[self._path(bucket, i, p["name"])]
                        flat[p["offset"]:p["offset"] + p["numel"]].copy_(value.reshape(-1))
                    into.copy_(flat[part])

    def fixed_bytes(self) -> int:
        """The bytes this rank holds for the buckets from step to step (state, gradient
        and gather slots; not a ZeRO-3 entry bucket's buffer, made and dropped in a step)."""
        return sum(self.fixed_parts().values())

    def fixed_parts(self) -> dict[str, int]:
        """fixed_bytes by part: `state` (compute weights, masters, moments, with clipping
        the held gradient parts), `gradient_slots`, `gather_slots`."""
        seen: set = set()
        return {part: _storage_bytes(tensors, seen) for part, tensors in (
            ("state", [t for b in self.buckets
                       for t in (*b.hi, *b.exp_avg, *b.exp_avg_sq, *b.held,
                                 *(x for x in b.lo if x is not None),
                                 *(w for w in b.weights if w is not None))]),
            ("gradient_slots", [t for b in self.buckets for t in b.grad_slots]),
            ("gather_slots", [t for b in self.buckets for t in b.slots]))}

    def buffer_numel(self) -> int:
        """The elements of the ZeRO-3 entry buffers held now (none between steps)."""
        return sum(b.buffer.numel() for b in self.buckets if b.buffer is not None)


def _gaps(spec: dict) -> list[tuple[int, int]]:
    """The ranges of a bucket's flat vector that no parameter covers (alignment padding)."""
    gaps, end = [], 0
    for p in sorted(spec["params"], key=lambda p: p["offset"]):
        if p["offset"] > end:
            gaps.append((end, p["offset"]))
        end = max(end, p["offset"] + p["numel"])
    return gaps + [(end, spec["numel"])] if end < spec["numel"] else gaps


def _storage_bytes(tensors: list[Tensor], seen: set) -> int:
    """The bytes of the storages of `tensors` not in `seen` (hi is a view of the weights
    below ZeRO-3), each once."""
    total = 0
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


OPS = {"copy_in": ZeroRun._copy_in, "all_reduce": ZeroRun._all_reduce,
       "reduce_scatter": ZeroRun._reduce_scatter, "adamw_shard": ZeroRun._adamw_shard,
       "all_gather": ZeroRun._all_gather, "allocate": ZeroRun._allocate,
       "release": ZeroRun._release}


def _ops_by_trigger(ops: list[dict]) -> dict[str, list[dict]]:
    by: dict[str, list[dict]] = {}
    for op in ops:
        kind = op.get("kind")
        if kind not in OPS and kind not in ("record_event", "wait_event"):
            raise RuntimeUserError(f"the IR's distributed section has an op `{kind}` this "
                                   f"runtime does not know",
                                   help=["rebuild the IR with this checkout's modulec"])
        by.setdefault(op["on"], []).append(op)
    return by


def refuse_parameter_settings(program) -> None:
    """Per-parameter `@trainable` settings are refused on several processes rather than
    ignored or computed wrong: a data-parallel shard is updated with one learning rate
    and weight decay, and a tensor-parallel rank's norm clip would see its slice only."""
    settings = program.metadata.get("training", {}).get("parameters", {})
    if settings:
        raise RuntimeUserError(f"@trainable settings ({', '.join(sorted(settings)[:3])}) are "
                               "not supported on several processes yet",
                               help=["train on one process, or remove the @trainable "
                                     "arguments"])


def check_group(dp: int, group=None) -> None:
    """The section was built for `dp` ranks: the run's data-parallel group must have that
    many."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world != dp:
        raise RuntimeUserError(f"the IR was built for {dp} data-parallel ranks; this run "
                               f"has {world}",
                               help=[f"launch with torchrun --nproc-per-node {dp}, or "
                                     f"rebuild with --dp {world}"])
