"""Pipeline parallel executed from the Schedule IR's `pipeline` section
(modulec/plan/pipeline.py says what it holds): rank r runs stage r % P of pipeline r // P
(one pipeline a data-parallel replica: runtime.dist.mesh).

The section is the contract. From it a stage takes:
- its units (entry nodes, and for a repeated call the layers [lo, hi] it runs);
- the boundary tensors it receives from stage s - 1 and sends to stage s + 1, in the
  section's order, with their shapes;
- its 1F1B op list, run in order: `forward` / `backward` (compute) and the sends and
  receives between them, each run of consecutive ones issued together as one
  `batch_isend_irecv` and completed before the next compute op (Megatron's
  send-forward-receive-backward pairing; see `_exchange`).

The runtime runs a stage's part of the entry function and of its derived backward with
the reference interpreter's own machinery (runtime.interpreter): the forward nodes of its
units, then the backward nodes whose `forward_node` is one of them (a repeated call's
backward only over its layers). A backward node with no `forward_node` (the `add` that sums
a fan-out's gradients) runs on the earliest stage any of its inputs comes from.

A boundary tensor's gradient is found in the backward function by the same rule on both
sides: the gradient of a layer output inside a repeated call (`f2[1].0`) is the value the
call's backward carries between those layers; the gradient of an entry value is the value
of its gradient sum that a later stage makes and an earlier one reads (`crossing`). The
entry's outputs go to the last stage, where the loss is (an auxiliary loss made earlier
crosses as a boundary tensor); an output's gradient seed is given there.
torch.distributed point-to-point calls move them (gloo on the CPU, NCCL on GPUs), in the
pipeline's process group. With data parallel over the pipelines (the section's mesh dp >
1), a stage's op list ends in `all_reduce` ops: each averages one of the stage's gradient
buckets (the section's offsets and shapes) over the stage's data-parallel group; under
ZeRO-1 then `optimizer_step` (the trainer's update, given to `step`) and one `broadcast`
per bucket of its weights from the replica that owns it.

A parameter two stages read, or two paths name (a tied LM head), is a `shared` entry of
the section: every stage holding it has a copy, its gradients of the entry's paths add up
under the entry's `param` (the tied target), and an `all_reduce` of group `shared` sums
them over the entry's stages (the mesh's group for it) before the optimizer steps.

Packed (--doc-sep), a micro-batch's documents (`documents_of`) are held around its
forward and its backward. `forward_only` runs one batch forward through the stages
outside the op list (evaluation): the activations received and sent as the schedule's
forwards do, no dropout, nothing kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from runtime.errors import RuntimeUserError
from runtime.interpreter import Frame, Interpreter
from runtime.kernels.documents import packed

INT_DTYPES = {"int32": torch.int32, "int64": torch.int64, "int16": torch.int16,
              "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool}
KNOWN_OPS = ("recv", "send", "forward", "backward", "all_reduce", "optimizer_step",
             "broadcast")


def layer_of(value: str) -> tuple[str, int, int] | None:
    """`f2[1].0` -> ("f2", 1, 0): output 0 of layer 1 of repeated call f2; else None."""
    node, bracket, rest = value.partition("[")
    if not bracket or "]." not in rest:
        return None
    layer, _, output = rest.partition("].")
    return (node, int(layer), int(output)) if layer.isdigit() and output.isdigit() else None


@dataclass
class StagePlan:
    """What stage `stage` of `stages` runs, as the section says."""

    stage: int
    stages: int
    units: dict  # entry node id -> (lo, hi) layers of a repeated call, or None
    incoming: list  # boundary tensors from stage - 1 (dicts of the section)
    outgoing: list  # boundary tensors to stage + 1
    ops: list
    stage_of: dict = field(default_factory=dict)  # (node id, layer or None) -> stage
    buckets: list = field(default_factory=list)  # gradient buckets (data parallel)
    shared: list = field(default_factory=list)  # the section's shared parameters

    @property
    def owners(self) -> dict[str, str]:
        """Each path of a shared entry -> the entry's `param` (a tied path: its target),
        the name the stage's gradient of it goes by."""
        from modulec.plan.pipeline_shared import owners

        return owners({"shared": self.shared})

    @classmethod
    def read(cls, section: dict, stage: int) -> "StagePlan":
        from modulec.plan.pipeline import unit_stages

        stages, stage_of = len(section["stages"]), unit_stages(section)
        mine = {u["node"]: tuple(u["layers"]) if "layers" in u else None
                for u in section["stages"][stage]["units"]}
        bounds = section["boundaries"]
        for op in section["ops"][stage]:
            kind = op.get("kind")
            collective = kind in ("all_reduce", "broadcast")
            known = (op.get("group"), op.get("reduce")) in (("dp", "avg"), ("shared", "sum")) \
                if kind == "all_reduce" else op.get("group") == "dp"
            if kind not in KNOWN_OPS or collective and not known:
                what = f" (group {op.get('group')}, reduce {op.get('reduce')})" \
                    if collective else ""
                raise RuntimeUserError(f"the IR's pipeline section has an op `{kind}`{what} "
                                       "this runtime does not know",
                                       help=["rebuild the IR with this checkout's modulec"])
        return cls(stage, stages, mine, bounds[stage - 1]["tensors"] if stage else [],
                   bounds[stage]["tensors"] if stage < stages - 1 else [],
                   section["ops"][stage], stage_of,
                   section["stages"][stage].get("grad_buckets", []),
                   section.get("shared", []))

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1


class GradientMap:
    """Where each boundary tensor's gradient lives in the backward function (both sides
    of a boundary compute the same): ("loop", call node, output k) inside a repeated
    call's backward, ("value", backward value id), or ("none",) when the node that made
    the tensor has no backward (`zeros`): zeros are sent, as the section's sizes say."""

    def __init__(self, graph, plan: StagePlan):
        self.graph, self.plan = graph, plan
        self.forward = graph.function(graph.entry)
        self.backward = graph.function(graph.backward)
        self.made_by = {o: n for n in self.backward.nodes for o in n.outputs if o}
        self.forward_made_by = {o: n for n in self.forward.nodes for o in n.outputs if o}
        self.inputs = {i.id for i in self.backward.inputs}
        self._stages: dict = {}

    def node_stage(self, node) -> int:
        """The stage a backward node runs on."""
        origin = node.attr("forward_node")
        if origin is not None:
            layer = 0 if node.kind == "call" else None  # a call's results: its layer 0
            return self.plan.stage_of[(origin, layer)]
        made = [self.value_stage(v) for v in node.inputs if v]
        return min(made) if made else self.plan.stages - 1

    def value_stage(self, value: str) -> int:
        if value not in self._stages:
            if value in self.inputs:  # an output's seed: given by the loss, on the last
                self._stages[value] = self.plan.stages - 1  # stage (outputs are sent there)
            elif value in self.made_by:
                self._stages[value] = self.node_stage(self.made_by[value])
            else:  # a forward value read by the backward: not a gradient
                self._stages[value] = -1
        return self._stages[value]

    def of(self, tensor: dict, boundary: int) -> tuple:
        """How the gradient of boundary tensor `tensor` (between stages `boundary` and
        `boundary + 1`) crosses."""
        inside = layer_of(tensor["value"])
        if inside is not None:
            if not any(n.kind == "call" and n.attr("forward_node") == inside[0]
                       for n in self.backward.nodes):  # no gradient flows through it
                return ("none",)
            return ("loop", inside[0], inside[2])
        read = self._read_gradient(tensor["value"])
        if read is None:  # its maker has no backward (zeros): nothing reads the gradient
            return ("none",)
        found = self._crossing(read, boundary)
        if found is None:
            raise RuntimeUserError(f"the pipeline boundary tensor {tensor['value']} has no "
                                   "gradient this runtime can find in the backward")
        return ("value", found)

    def _read_gradient(self, value: str) -> str | None:
        """The backward value that is the whole gradient of forward `value`: what the
        backward of the node that made it reads."""
        from runtime.interpreter import _expand, _forward_names
        from runtime.kernels import KERNELS

        producer = self.forward_made_by.get(value)
        if producer is None:
            return None
        node = next((n for n in self.backward.nodes
                     if n.attr("forward_node") == producer.id and n.target != "add"), None)
        if node is None:
            return None
        if producer.kind == "call":
            return node.inputs[list(producer.outputs).index(value)] or None
        kernel = KERNELS[producer.target]
        names = _forward_names(kernel, producer)
        for name, read in zip(_expand(kernel.backward_inputs, node.inputs), node.inputs):
            if name.startswith("d_") and names.get(name[2:]) == value:
                return read or None
        return None

    def _crossing(self, value: str, boundary: int) -> str | None:
        """The value of `value`'s gradient sum made after `boundary` (and read at or
        before it)."""
        if self.value_stage(value) > boundary:
            return value
        node = self.made_by.get(value)
        if node is None or node.attr("forward_node") is not None:
            return None
        for part in node.inputs:  # an `add` of the fan-out's contributions
            found = self._crossing(part, boundary) if part else None
            if found is not None:
                return found
        return None


def shared_sums(backward, made_by: dict, owners: dict) -> dict:
    """The `add` nodes (no `forward_node`) that sum the gradient contributions of a shared
    parameter (one of `owners`' paths) in the entry's backward, by the value each makes:
    its contributions may come from several stages."""
    found, todo = {}, [v for name, v in backward.param_grads if name in owners]
    while todo:
        node = made_by.get(todo.pop())
        if node is not None and node.attr("forward_node") is None and node.target == "add":
            found.update({o: node for o in node.outputs if o})
            todo += [v for v in node.inputs if v]
    return found


class StageRunner:
    """Runs one stage's forwards and backwards per micro-batch and its op list."""

    def __init__(self, graph, section: dict, stage: int, interpreter: Interpreter,
                 device: str, precision, mesh=None):
        """`precision`: runtime.train.pipeline_precision.StagePrecision (the compute dtype,
        the dtype a step's gradients are summed and bucketed in, the fp32 masters the
        interpreter's compute copies are made from); `mesh`: runtime.dist.mesh.PipelineMesh
        (its groups, the global rank of a stage of this rank's pipeline); None: one
        pipeline on the default group."""
        self.graph, self.it, self.device = graph, interpreter, device
        self.precision, self.dtype, self.grad_dtype = precision, precision.compute, \
            precision.grads
        self.mesh = mesh
        self.plan = plan = StagePlan.read(section, stage)
        self.entry = graph.function(graph.entry)
        self.backward_fn = graph.function(graph.backward)
        grads = GradientMap(graph, plan)
        self.grad_in = [grads.of(t, stage) for t in plan.outgoing if t["gradient"]]
        self.grad_out = [grads.of(t, stage - 1) for t in plan.incoming if t["gradient"]]
        # the sums of a shared parameter's gradient contributions (each stage adds its own
        # and the section's shared all-reduce the stages'): value -> its `add` node
        self.shared_sums = shared_sums(self.backward_fn, grads.made_by, plan.owners)
        skipped = {id(n) for n in self.shared_sums.values()}
        self.backward_nodes = [n for n in self.backward_fn.nodes
                               if id(n) not in skipped and self._runs_here(n, grads)]
        self.frames: dict[int, Frame] = {}
        self.seed_of = None  # micro-batch -> the random ops' seed (dropout), None: off
        # micro-batch -> its packed documents (--doc-sep: runtime.kernels.documents, held
        # around its forward and its backward), None: unpacked
        self.documents_of = None

    def _runs_here(self, node, grads: GradientMap) -> bool:
        origin = node.attr("forward_node")
        if origin is not None:
            return origin in self.plan.units
        return grads.node_stage(node) == self.plan.stage

    # ------------------------------------------------------------------ the op list
    def step(self, inputs: list[dict], loss_of, update=None) -> tuple[list[float], dict]:
        """One step over the micro-batches: `inputs[m]` the step inputs by entry input
        id; `loss_of(m, outputs)` (last stage) -> (loss, seeds); `update(total)`: the
        optimizer, at the section's `optimizer_step` op (ZeRO-1; without one the caller
        steps after). Returns the losses (last stage) and the parameter gradients summed
        over the micro-batches (averaged over the DP group where the section says)."""
        inbox, outbox, seeds, losses, total = {}, {}, {}, [], {}
        ops, i, owners = self.plan.ops, 0, self.plan.owners
        while i < len(ops):
            kind, m = ops[i]["kind"], ops[i].get("microbatch")
            if ops[i].get("group") == "shared":  # a shared parameter's copies' sum
                self._sum_shared(ops[i]["shared"], total)
            elif kind == "all_reduce":  # after the last backward: total is final here
                self._all_reduce(self.plan.buckets[ops[i]["bucket"]], total)
            elif kind == "optimizer_step":
                update(total)
            elif kind == "broadcast":  # ZeRO-1: the owner's updated weights
                self._broadcast(self.plan.buckets[ops[i]["bucket"]], ops[i]["root"])
            elif kind in ("send", "recv"):  # a run of them: one exchange
                j = i
                while j < len(ops) and ops[j]["kind"] in ("send", "recv"):
                    j += 1
                self._exchange(ops[i:j], inbox, outbox)
                i = j
                continue
            elif kind == "forward":
                with packed(self._documents(m)):
                    outputs, outbox[("activations", m)] = self.forward(
                        m, inputs[m], inbox.pop(("activations", m), []))
                if self.plan.last:
                    loss, seeds[m] = loss_of(m, outputs)
                    losses.append(loss)
            else:
                with packed(self._documents(m)):
                    grads, outbox[("gradients", m)] = self.backward(
                        m, seeds.pop(m, None), inbox.pop(("gradients", m), []))
                for path, grad in grads.items():  # a tied path's: its owner's
                    path = owners.get(path, path)
                    if path in total:  # in place, converting as it adds (one pass)
                        total[path].add_(grad)
                    else:  # a sum of its own: never the interpreter's tensor
                        total[path] = grad.to(self.grad_dtype, copy=True)
            i += 1
        self.it.rng_seed = None
        return losses, total

    def _documents(self, m: int):
        return self.documents_of(m) if self.documents_of is not None else None

    @torch.no_grad()
    def forward_only(self, inputs: dict, documents=None) -> list | None:
        """One batch's forward through the pipeline, as the schedule's forwards run and
        send (evaluation): the activations received from stage s - 1, this stage's units
        run (no dropout, no frame kept for a backward), the boundary tensors sent to
        stage s + 1; the entry's outputs on the last stage, else None."""
        inbox, outbox, stage = {}, {}, self.plan.stage
        if stage:
            self._exchange([{"kind": "recv", "what": "activations", "microbatch": -1,
                             "peer": stage - 1}], inbox, outbox)
        with packed(documents):
            outputs, sent = self.forward(-1, inputs, inbox.pop(("activations", -1), []),
                                         train=False)
        if not self.plan.last:
            outbox[("activations", -1)] = sent
            self._exchange([{"kind": "send", "what": "activations", "microbatch": -1,
                             "peer": stage + 1}], inbox, outbox)
        self.it.rng_seed = None
        return outputs

    def _exchange(self, ops: list[dict], inbox: dict, outbox: dict) -> None:
        """Consecutive sends and receives as one `batch_isend_irecv` (on NCCL one group:
        a stage's send to its neighbour and its receive from it progress together; issued
        one by one on NCCL's single stream per pair, 1F1B's send-then-receive on both
        sides would wait on each other), then waited for before the next compute op."""
        p2p = []
        group = self.mesh.pp_group if self.mesh is not None else None
        for op in ops:
            key = (op["what"], op["microbatch"])
            peer = self.mesh.rank_of(op["peer"]) if self.mesh is not None else op["peer"]
            if op["kind"] == "recv":
                inbox[key] = self._buffers(op["what"])
                p2p += [dist.P2POp(dist.irecv, b, peer, group) for b in inbox[key]]
            else:
                p2p += [dist.P2POp(dist.isend, t, peer, group) for t in outbox.pop(key)]
        for work in dist.batch_isend_irecv(p2p) if p2p else ():
            work.wait()

    def _all_reduce(self, bucket: dict, total: dict) -> None:
        """One gradient bucket of the section averaged over the stage's data-parallel
        group: this rank's sums over its micro-batches packed at the bucket's offsets (a
        parameter without a gradient here adds zeros), all-reduced, divided by the group's
        size, and handed back as views of the flat buffer."""
        flat = torch.zeros(bucket["numel"], dtype=self.grad_dtype, device=self.device)
        for row in bucket["params"]:
            grad = total.get(row["path"])
            if grad is not None:
                flat[row["offset"]:row["offset"] + row["numel"]].copy_(grad.reshape(-1))
        dist.all_reduce(flat, group=self.mesh.dp_group)
        flat /= self.mesh.dp
        for row in bucket["params"]:
            if row["path"] in total:
                part = flat[row["offset"]:row["offset"] + row["numel"]].view(row["shape"])
                total[row["path"]] = part.to(total[row["path"]].dtype)

    def _sum_shared(self, index: int, total: dict) -> None:
        """Shared entry `index`'s gradient summed over the stages that hold a copy (its
        group in this rank's pipeline; a stage that made none adds zeros), so that every
        copy steps alike."""
        entry = self.plan.shared[index]
        grad = total.get(entry["param"])
        if grad is None:
            grad = torch.zeros(entry["shape"], dtype=self.grad_dtype, device=self.device)
        grad = grad.contiguous()
        dist.all_reduce(grad, group=self.mesh.shared_groups[index])
        total[entry["param"]] = grad

    def _broadcast(self, bucket: dict, root: int) -> None:
        """A bucket's weights from the replica that stepped them (its owner, a data-
        parallel index) to the stage's DP group, flat at the section's offsets (the fp32
        masters where the stage has them, its compute copies made from them after)."""
        params = self.precision.weights(self.it.params)
        flat = torch.cat([params[row["path"]].detach().reshape(-1)
                          for row in bucket["params"]])
        dist.broadcast(flat, src=self.mesh.replica_rank(root),
                       group=self.mesh.dp_group)
        with torch.no_grad():
            for row in bucket["params"]:
                part = flat[row["offset"]:row["offset"] + row["numel"]]
                params[row["path"]].copy_(part.view(row["shape"]))
        self.precision.refresh(self.it.params, [row["path"] for row in bucket["params"]])

    def _buffers(self, what: str) -> list[Tensor]:
        """Receive buffers for the section's tensors of `what`, in its order and shapes."""
        tensors = self.plan.incoming if what == "activations" else \
            [t for t in self.plan.outgoing if t["gradient"]]
        return [torch.empty(spec["shape"], dtype=self._wire_dtype(spec), device=self.device)
                for spec in tensors]

    def _wire_dtype(self, spec: dict) -> torch.dtype:
        """The dtype boundary tensor `spec` (and its gradient) has on both sides: the one
        the interpreter makes it in (bf16 stages: the MoE router statistics' fp32 sums
        cross as fp32)."""
        name = spec["dtype"]
        return INT_DTYPES[name] if name in INT_DTYPES else self.it.float_dtype(name)

    # ------------------------------------------------------------------ forward
    def forward(self, m: int, inputs: dict, received: list,
                train: bool = True) -> tuple[list | None, list]:
        """Micro-batch m's forward of this stage's units: (the entry's outputs on the last
        stage, else None; the tensors to send on). `train` False: no dropout, and its
        frame is not kept for a backward (evaluation)."""
        seeded = train and self.seed_of is not None
        self.it.rng_seed = self.seed_of(m) if seeded else None
        frame = Frame(self.entry, "", ())
        frame.env.update(inputs)
        frame.env.update({t["value"]: v for t, v in zip(self.plan.incoming, received)})
        for node in self.entry.nodes:
            if node.kind == "alias":
                if node.inputs[0] in frame.env:
                    frame.env[node.outputs[0]] = frame.env[node.inputs[0]]
            elif node.id in self.plan.units:
                layers = self.plan.units[node.id]
                if layers is None:
                    self.it._dispatch(node, frame, None)
                else:
                    self._forward_layers(node, frame, *layers)
        if train:
            self.frames[m] = frame
        sent = [frame.env[t["value"]].to(self._wire_dtype(t)).contiguous()
                for t in self.plan.outgoing]
        outputs = [frame.env.get(o) for o in self.entry.outputs] if self.plan.last else None
        return outputs, sent

    def _forward_layers(self, node, frame: Frame, lo: int, hi: int) -> None:
        callee = self.graph.function(node.target)
        if lo == 0:
            values = [self.it._read(v, frame, None) if v else None for v in node.inputs]
        else:  # the layer before lo ran on the stage before: received
            values = [frame.env[f"{node.id}[{lo - 1}].{k}"] for k in range(len(callee.outputs))]
        for layer in range(lo, hi + 1):
            child = self.it._child_frame(callee, frame, node, layer)
            frame.children[(node.id, layer)] = child
            values = self.it._run(child, values, None)
        if hi == int(node.repeat) - 1:
            frame.env.update({o: v for o, v in zip(node.outputs, values) if o})
        else:
            frame.env.update({f"{node.id}[{hi}].{k}": v for k, v in enumerate(values)})

    # ------------------------------------------------------------------ backward
    def backward(self, m: int, seeds: list | None, received: list) -> tuple[dict, list]:
        """Micro-batch m's backward of this stage: (parameter gradients by path, the
        gradients to send back)."""
        forward = self.frames.pop(m)
        frame = Frame(self.backward_fn, "", ())
        if seeds is not None:
            frame.env.update({i.id: s for i, s in zip(self.backward_fn.inputs, seeds)})
        loops = {}
        for (kind, *where), tensor in zip(self.grad_in, received):
            if kind == "value":
                frame.env[where[0]] = tensor
            elif kind == "loop":
                loops.setdefault(where[0], {})[where[1]] = tensor
        self.it.grads = {}
        carried = {}
        for node in self.backward_nodes:
            layers = self.plan.units.get(node.attr("forward_node"))
            if node.kind == "call" and layers is not None:
                carried.update(self._backward_layers(node, frame, forward, loops, *layers))
            else:
                self.it._dispatch(node, frame, forward)
        self.it._collect_param_grads(frame)
        self._collect_shared(frame)
        return self.it.grads, [self._gradient_out(g, t, frame, carried) for g, t in
                               zip(self.grad_out, self._incoming_with_gradient())]

    def _collect_shared(self, frame: Frame) -> None:
        """This stage's part of each shared parameter's gradient: its own contributions
        to the gradient sum (the `add`s of the others' are not run here)."""
        for name, value in self.backward_fn.param_grads:
            if value in self.shared_sums:
                part = self._local_sum(value, frame)
                if part is not None:
                    grads = self.it.grads
                    grads[name] = grads[name] + part if name in grads else part

    def _local_sum(self, value: str, frame: Frame) -> Tensor | None:
        """The sum's terms made on this stage, added in the sum's own order (None: none)."""
        node = self.shared_sums.get(value)
        if node is None:  # a contribution: made here, or on another stage (absent)
            return frame.env.get(value)
        parts = [self._local_sum(v, frame) for v in node.inputs if v]
        parts = [p for p in parts if p is not None]
        total = parts[0] if parts else None
        for part in parts[1:]:
            total = total + part
        return total

    def _incoming_with_gradient(self) -> list:
        return [t for t in self.plan.incoming if t["gradient"]]

    def _gradient_out(self, where: tuple, spec: dict, frame: Frame, carried: dict) -> Tensor:
        kind = where[0]
        dtype = self._wire_dtype(spec)
        if kind == "none":
            return torch.zeros(spec["shape"], dtype=dtype, device=self.device)
        value = frame.env.get(where[1]) if kind == "value" else carried.get(where[1:])
        if value is None:  # no gradient reached it this step: zero
            return torch.zeros(spec["shape"], dtype=dtype, device=self.device)
        return value.to(dtype).contiguous()

    def _backward_layers(self, node, frame: Frame, forward: Frame, loops: dict, lo: int,
                         hi: int) -> dict:
        """A repeated call's backward over layers hi .. lo; returns the gradients it
        carries out below lo (by (call, output)) when layer lo - 1 is on another stage."""
        callee = self.graph.function(node.target)
        origin = node.attr("forward_node")
        if hi == int(node.repeat) - 1:
            values = [self.it._read(v, frame, forward) if v else None for v in node.inputs]
        else:  # the layers above hi ran on the next stage: received
            given = loops.get(origin, {})
            values = [given.get(k) for k in range(len(callee.inputs))]
        for layer in reversed(range(lo, hi + 1)):
            child = forward.children[(origin, layer)]
            own = Frame(callee, child.path, child.indices)
            values = self.it._zeros_for_absent(values, child)
            values = self.it._run(own, values, child)
        if lo == 0:
            frame.env.update({o: v for o, v in zip(node.outputs, values) if o})
            return {}
        return {(origin, k): v for k, v in enumerate(values)}
