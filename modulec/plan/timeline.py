"""A training step flattened: every primitive node of every function instance in the order
it runs (the entry's forward, then its backward), with its predicted time, and the storage
each instance's values live in.

An instance is named by its path from the entry: `(("f2", 3), ("f1", 0))` is the first
call `f1` inside the fourth repetition of call `f2` (block 3's attention). A storage is
keyed `(path, value id)` of the instance that writes it; a callee's input is the caller's
storage (no copy), a view (view, transpose, permute, split) is its source's storage, and
a repeated call feeds each repetition's outputs to the next one's inputs, and an op
that runs in place (modulec.plan.in_place: RoPE inside the fused QKV output) writes
its outputs into its inputs' storages, and a `contiguous` of a value already laid out
contiguously (modulec.plan.layouts) is a view. A backward
instance reads the storages of the forward instance it differentiates (its `forward_node`
call, repetitions in reverse). Saved storages are those a backward op reads.

Replays (modulec.plan.replay) stay inside a region: one block of a stack (the first step
of a path), or one op of the entry function.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from modulec.ir.graph import Graph, Node
from modulec.plan.cost import VIEW_OPS, node_cost, value_table
from modulec.plan.devices import Device
from modulec.plan.from_graph import _bytes
from modulec.plan.in_place import IN_PLACE_OUTPUTS, in_place_nodes
from modulec.plan.layouts import free_contiguous
from modulec.plan.memory.model import round_up

Key = tuple  # (instance path, value id)
ALIGNMENT = 256


@dataclass(frozen=True)
class OpRun:
    index: int
    function: str          # the IR function holding the node
    path: tuple            # the forward instance it belongs to (a backward: the one it reads)
    node: Node
    reads: tuple           # storage keys it reads (a backward op: forward storages only)
    writes: tuple          # storage keys it writes (forward ops)
    seconds: float
    backward: bool


@dataclass
class Storage:
    key: Key
    bytes: int
    function: str
    producer: int | None = None                 # forward op writing it (None: step input)
    names: list = field(default_factory=list)   # source names of the values viewing it
    readers: list = field(default_factory=list)  # op indices reading it, in order
    in_place: bool = False                        # an op wrote over it (modulec.plan.in_place)

    last_read_forward: int = 0                   # its last forward use (or producer)
    reads_backward: list = field(default_factory=list)  # backward ops reading it


@dataclass
class Step:
    ops: list[OpRun]
    storages: dict[Key, Storage]
    forward_ops: int                       # ops[:forward_ops] are the forward
    instances: dict[tuple, str]            # forward instance path -> function name
    envs: dict[tuple, dict] = field(repr=False, default_factory=dict)
    _saved: list | None = field(repr=False, default=None)

    def saved(self) -> list[Key]:
        """Storages a backward op reads that some forward op writes, in forward order."""
        if self._saved is None:
            self._saved = [k for k, s in self.storages.items()
                           if s.producer is not None and s.reads_backward]
        return self._saved

    def seconds(self) -> tuple[float, float]:
        forward = sum(op.seconds for op in self.ops[:self.forward_ops])
        return forward, sum(op.seconds for op in self.ops[self.forward_ops:])


def flatten(graph: Graph, device: Device, training: str = "full") -> Step:
    walker = _Walker(graph, device, training)
    entry = graph.function(graph.entry)
    env = {}
    for value in entry.inputs:
        env[value.id] = ((), value.id)
        walker.storage(((), value.id), entry.name, value, None)
    walker.forward(graph.entry, (), env)
    forward_ops = len(walker.ops)
    if graph.backward:
        walker.backward(graph.backward, ())
    for op in walker.ops:
        for key in op.reads:
            walker.storages[key].readers.append(op.index)
    for storage in walker.storages.values():
        forward = [i for i in storage.readers if i < forward_ops]
        storage.last_read_forward = max(forward + [storage.producer or 0])
        storage.reads_backward = [i for i in storage.readers if i >= forward_ops]
    return Step(walker.ops, walker.storages, forward_ops, walker.instances, walker.envs)


class _Walker:
    def __init__(self, graph: Graph, device: Device, training: str):
        self.graph, self.device, self.training = graph, device, training
        self.ops: list[OpRun] = []
        self.storages: dict[Key, Storage] = {}
        self.instances: dict[tuple, str] = {}
        self.envs: dict[tuple, dict] = {}
        self._tables: dict[str, object] = {}
        self._times: dict[tuple, float] = {}
        self._in_place: dict[str, frozenset] = {}
        self._free: dict[str, frozenset] = {}

    def storage(self, key: Key, function: str, value, producer) -> None:
        self.storages[key] = Storage(key, round_up(_bytes(value), ALIGNMENT), function,
                                     producer, [value.name] if value.name else [])

    def seconds(self, function, node: Node) -> float:
        key = (function.name, node.id)
        if key not in self._times:
            table = self._tables.setdefault(function.name, value_table(self.graph, function))
            self._times[key] = node_cost(table, node, self.training).seconds(self.device)
        return self._times[key]

    # ------------------------------------------------------------------ forward
    def forward(self, name: str, path: tuple, env: dict) -> list:
        function = self.graph.function(name)
        self.instances[path] = name
        self.envs[path] = env
        own = {v.id: v for v in function.values}
        for node in function.nodes:
            if node.kind == "call":
                self._call(node, path, env)
            elif node.kind == "alias" or node.target in VIEW_OPS \
                    or node.id in self._free_contiguous(function):
                self._view(node, env, own)
            else:
                self._op(function, node, path, env, own)
        return [env.get(o) for o in function.outputs]

    def _call(self, node: Node, path: tuple, env: dict) -> None:
        callee = self.graph.function(node.target)
        args = [env.get(i) for i in node.inputs]
        for repetition in range(int(node.repeat)):
            inner = {v.id: a for v, a in zip(callee.inputs, args) if a is not None}
            args = self.forward(node.target, path + ((node.id, repetition),), inner)
        for value_id, key in zip(node.outputs, args):
            if key is not None:
                env[value_id] = key

    def _view(self, node: Node, env: dict, own: dict) -> None:
        source = env.get(node.inputs[0]) if node.inputs else None
        for value_id in node.outputs:
            if source is None:
                continue
            env[value_id] = source
            value = own.get(value_id)
            if value is not None and value.name:
                self.storages[source].names.append(value.name)

    def _op(self, function, node: Node, path: tuple, env: dict, own: dict) -> None:
        index = len(self.ops)
        writes = []
        over = self._over_inputs(function, node)
        for position, value_id in enumerate(node.outputs):
            if position in over and node.inputs[over[position]] in env:
                self._write_over(env, node.inputs[over[position]], value_id, own)
            elif value_id in own:
                key = (path, value_id)
                self.storage(key, function.name, own[value_id], index)
                env[value_id] = key
                writes.append(key)
        reads = tuple(dict.fromkeys(env[i] for i in node.inputs if i in env))
        self.ops.append(OpRun(index, function.name, path, node, reads, tuple(writes),
                              self.seconds(function, node), False))

    def _free_contiguous(self, function) -> frozenset:
        if function.name not in self._free:
            self._free[function.name] = free_contiguous(function)
        return self._free[function.name]

    def _over_inputs(self, function, node: Node) -> dict:
        """{output position: input position} the node writes over (in place), or {}."""
        if function.name not in self._in_place:
            self._in_place[function.name] = in_place_nodes(self.graph, function)
        if node.id not in self._in_place[function.name]:
            return {}
        return dict(IN_PLACE_OUTPUTS[node.target])

    def _write_over(self, env: dict, source: str, value_id: str, own: dict) -> None:
        storage = self.storages[env[source]]
        storage.in_place = True
        env[value_id] = storage.key
        value = own.get(value_id)
        if value is not None and value.name:
            storage.names.append(value.name)

    # ------------------------------------------------------------------ backward
    def backward(self, name: str, path: tuple) -> None:
        function = self.graph.function(name)
        env = self.envs.get(path, {})
        saved = set(function.saved)
        for node in function.nodes:
            if node.kind == "call":
                forward_node = node.attr("forward_node", node.id)
                count = int(node.repeat)
                for repetition in range(count):
                    self.backward(node.target, path + ((forward_node, count - 1 - repetition),))
            elif node.kind == "op":
                reads = tuple(dict.fromkeys(env[i] for i in node.inputs
                                            if i in saved and i in env))
                self.ops.append(OpRun(len(self.ops), name, path, node, reads, (),
                                      self.seconds(function, node), True))
