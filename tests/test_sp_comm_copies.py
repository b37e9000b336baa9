"""What the tensor- and sequence-parallel collectives cost per layer, without a GPU: the
reference comm kernels (runtime/kernels/comm.py, which the GPU step runs as they are) on
one process with the collectives faked (the other rank holds the same values), every
copy they make counted by a dispatch mode, then summed over the comm nodes of one
layer of the tiny Llama's rank program (forward and backward).

Sequence parallel copies no activation (a rank's rows are a contiguous block of the
tokens: NCCL gathers into and reduce-scatters from the tensors themselves) where tensor
parallel alone makes 8 copies a layer; it issues an all-gather and a reduce-scatter for
each all-reduce (the same bytes), and two more collectives a layer: the norms' weight
gradients summed over the ranks."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from runtime.kernels import KERNELS  # noqa: E402
from tests.test_sequence_parallel import sp_build  # noqa: E402

SIZE, RANK = 2, 1
COPIES = {"clone", "copy_", "cat", "_to_copy", "_reshape_copy"}
COMM = ("tp_copy", "tp_all_reduce", "sp_all_gather", "sp_reduce_scatter", "sp_scatter",
        "sp_gather")


class Counted(TorchDispatchMode):
    """Elements written by copying ops, and collectives issued (the fakes pause it)."""

    def __init__(self):
        super().__init__()
        self.copied, self.collectives, self.paused = 0, 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.paused and func.__name__.split(".")[0] in COPIES:
            self.copied += sum(t.numel() for t in (out if isinstance(out, (list, tuple))
                                                   else [out]))
        return out


@pytest.fixture
def counted(monkeypatch):
    """A two-rank group faked in this process: rank RANK, the other rank's tensors equal
    to this one's."""
    import runtime.dist.collectives as collectives
    import runtime.kernels.comm as comm

    mode = Counted()

    def fake(fn):
        def run(*args, **kwargs):
            mode.collectives += 1
            mode.paused = True
            try:
                fn(*args)
            finally:
                mode.paused = False
        return run

    def gather(out, part, group=None):
        out.view(SIZE, -1).copy_(part.reshape(1, -1))

    def reduce_scatter(out, tensor, group=None):
        out.view(-1).copy_(tensor.view(SIZE, -1)[RANK] * SIZE)

    def all_reduce(tensor, op=None, group=None):
        tensor.mul_(SIZE)

    monkeypatch.setattr(collectives, "all_gather_into", fake(gather))
    monkeypatch.setattr(collectives, "reduce_scatter_into", fake(reduce_scatter))
    monkeypatch.setattr(torch.distributed, "all_reduce", fake(all_reduce))
    monkeypatch.setattr(comm, "process_group", lambda size, name="tp": None)
    monkeypatch.setattr(comm, "group_rank", lambda size, group="tp": RANK)
    return mode


def run(mode: Counted, op: str, direction: str, x):
    """(the kernel's output, elements copied, collectives issued)."""
    kernel = KERNELS[op]
    fn = kernel.forward_fn if direction == "forward" else kernel.backward_fn
    mode.copied = mode.collectives = 0
    attrs = {"size": SIZE} | ({"dim": 1} if op.startswith("sp_") else {})
    with mode:
        out = fn(x, **attrs)[0]
    return out, mode.copied, mode.collectives


@pytest.mark.parametrize("rows", [4, 1])
def test_the_sequence_collectives_copy_nothing(counted, rows):
    """A rank's block is a contiguous block of the B x T tokens: gathered straight into
    the result, reduce-scattered straight from the input."""
    local = torch.randn(rows, 3, 8, dtype=torch.float64)
    whole = torch.randn(rows, 6, 8, dtype=torch.float64)
    mine = whole.reshape(2, -1)[RANK].view(rows, 3, 8)  # rank 1's half of the tokens
    joined = torch.cat([local.reshape(1, -1)] * SIZE).view(rows, 6, 8)
    for op, direction, x, want in [
            ("sp_all_gather", "forward", local, joined),
            ("sp_all_gather", "backward", whole, SIZE * mine),
            ("sp_reduce_scatter", "forward", whole, SIZE * mine),
            ("sp_reduce_scatter", "backward", local, joined),
            ("sp_gather", "forward", local, joined),
            ("sp_scatter", "backward", local, joined)]:
        out, got, collectives = run(counted, op, direction, x)
        assert torch.equal(out, want), (op, direction)
        assert (got, collectives) == (0, 1), (op, direction)
        assert out.is_contiguous() and out.data_ptr() != x.data_ptr()
    # this rank's rows of a replicated tensor: a copy (a fresh value), no communication
    for op, direction in (("sp_scatter", "forward"), ("sp_gather", "backward")):
        out, got, collectives = run(counted, op, direction, whole)
        assert torch.equal(out, mine) and (got, collectives) == (mine.numel(), 0)
    if rows == 1:  # one sequence: the tokens' block is the sequence's
        assert torch.equal(mine, whole[:, 3:])


def _layer_nodes(graph, name: str, direction: str) -> list:
    """The nodes of one layer (the block and what it calls) in `direction`."""
    function = graph.function(name if direction == "forward" else f"{name}.backward")
    nodes = []
    for node in function.nodes:
        if node.kind == "call":
            nodes += _layer_nodes(graph, node.target.removesuffix(".backward"), direction)
        else:
            nodes.append((node, function))
    return nodes


def layer_cost(mode: Counted, sp: bool) -> dict:
    """Per layer of the tiny Llama (B=2, T=6): copies of activation-sized tensors (in
    units of one [B, T, d] activation), copied parameter elements, collectives."""
    graph = sp_build(sp=sp).graph
    whole = 2 * 6 * 32
    cost = {"activation copies": 0.0, "weight elements copied": 0, "collectives": 0}
    for direction in ("forward", "backward"):
        for node, function in _layer_nodes(graph, "DenseTransformerBlock#1", direction):
            op = node.target.removesuffix("_backward")
            if op not in COMM:
                continue
            shape = tuple(int(d) for d in function.value(node.inputs[0]).shape)
            _, copied, collectives = run(mode, op, direction, torch.randn(shape))
            cost["collectives"] += collectives
            if len(shape) > 1:
                cost["activation copies"] += copied / whole
            else:
                cost["weight elements copied"] += copied
    return cost


def test_sequence_parallel_copies_no_activation_per_layer(counted):
    tp, sp = layer_cost(counted, sp=False), layer_cost(counted, sp=True)
    # TP: each region's tp_copy and tp_all_reduce copy their input, forward and backward
    assert tp == {"activation copies": 8.0, "weight elements copied": 0, "collectives": 4}
    # SP: no copy; each region's all-gather and reduce-scatter forward and backward (an
    # all-gather and a reduce-scatter move an all-reduce's bytes: 8); the norms' two
    # weights copied (tp_copy) and their gradients all-reduced (2)
    assert sp == {"activation copies": 0.0, "weight elements copied": 4 * 32,
                  "collectives": 10}
