"""The GPU step's asynchronous collectives (modulec.lower.tp_overlap): an op the IR marks
`stream=comm` runs on a communication stream (runtime/dist/streams.py's CudaStreams, the
step's own: not the ZeRO run's, where a tensor-parallel all-reduce would queue behind
the data-parallel gradient collectives and the compute stream's wait with it), and the
compute stream joins it at the op's `wait` node. The order of the collectives on one
process group is the order they are issued in (ProcessGroupNCCL runs a group's on one
NCCL stream), the same on every rank, whatever stream each is issued from.

    issue:  compute records `tp:<function>/<op>:ready`; comm waits for it (the op's
            input is made), runs the op (its outputs placed in their planned bytes on
            comm too) and records `...:done`
    wait:   compute waits for `...:done`

Each event is recorded every step before it is waited on, so the step stays one CUDA
graph (ZeRO's events and NCCL calls on the comm stream are captured the same way). The
planner keeps the op's input and output bytes until the wait (modulec.plan.from_graph);
tensors of torch's caching allocator are marked used by the other stream
(`record_stream`: a block freed later is not handed out before that stream's work is
done) and held until the wait.
"""

from __future__ import annotations

import torch

from modulec.ir.graph import COMM, COMM_STREAM, COMPUTE_STREAM, STREAM, WAIT



def has_async(graph) -> bool:
    """Whether any function of `graph` issues an op on the communication stream."""
    return any(n.kind == WAIT for f in graph.functions for n in f.nodes)


def step_streams(graph):
    """The streams the async collectives of a step running `graph` run on (made once, when
    the step is set up; the compute stream is set by each run, `begin_step`); None when
    its graph has none."""
    if not has_async(graph):
        return None
    from runtime.dist.streams import CudaStreams

    return CudaStreams()


class InFlight:
    """The async ops issued and not yet joined, on `streams` (CudaStreams, or InOrder)."""

    def __init__(self, streams):
        self.streams = streams
        self.held: dict = {}  # (id(frame), op id) -> the tensors it reads and writes
        self.issued = 0  # ops issued on the comm stream (a count for tests and reports)

    def issue(self, run, node, frame, forward, op) -> None:
        """Run `op(node, frame, forward)` (the interpreter's op) on the comm stream."""
        if node.attr(STREAM) != COMM:
            raise RuntimeError(f"{node.id}: `stream={node.attr(STREAM)}` is not a stream "
                               "of this runtime")
        # the op's inputs, read before it is issued (what it reads, not what it writes);
        # a value to restore is restored here, on the compute stream, before `ready`
        reads = [run._read(v, frame, forward) for v in node.inputs if v]
        key = _key(frame, node.id)
        self.streams.record(COMPUTE_STREAM, f"{key}:ready")
        self.streams.wait(COMM_STREAM, f"{key}:ready")
        with self.streams.on(COMM_STREAM):
            op(node, frame, forward)
            self.streams.record(COMM_STREAM, f"{key}:done")
        writes = [frame.env[v] for v in node.outputs if v and v in frame.env]
        _used_by(reads, getattr(self.streams, "comm", None))
        _used_by(writes, getattr(self.streams, "compute", None))
        self.held[(id(frame), node.id)] = reads + writes
        self.issued += 1

    def wait(self, node, frame) -> None:
        """The compute stream joins op `node.target` of this function run."""
        if (id(frame), node.target) not in self.held:
            raise RuntimeError(f"{frame.function.name}: `wait {node.target}` with no "
                               f"{node.target} issued on the communication stream")
        self.streams.wait(COMPUTE_STREAM, f"{_key(frame, node.target)}:done")
        del self.held[(id(frame), node.target)]


def _key(frame, op_id: str) -> str:
    """One pair of events per op of a function, reused by every run of it (a layer's
    run joins its op before the next layer's records the events again)."""
    return f"tp:{frame.function.name}/{op_id}"


def _used_by(tensors, stream) -> None:
    if stream is None:
        return
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.is_cuda:
            tensor.record_stream(stream)
