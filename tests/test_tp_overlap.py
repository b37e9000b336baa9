"""The `tp_overlap` pass (modulec/lower/tp_overlap.py): under `--tp` each backward
collective that alone reads a matmul backward's input gradient is issued on the
communication stream between the split matmul backward's two GEMMs and joined by a `wait`
node; the verifier's checks of that structure, the printer's text, the planner keeping
the collective's bytes to the wait, `--no-tp-overlap`, and the GPU step's issue / wait
bookkeeping on a recording stand-in for the streams. The CPU gloo equality of the
overlapped programs: tests/test_tensor_parallel.py, test_sequence_parallel.py; on two
GPUs: tests/test_cuda_dist.py::test_tp_overlap_trains_as_in_order."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from modulec.ir.graph import COMM, STREAM, WAIT, Function, Graph, Node, ValueInfo
from modulec.ir.printer import node_text
from modulec.ir.verify import verify_graph
from modulec.ir.verify_async import async_problems
from modulec.lower.schedule import kernel_of
from modulec.lower.tp_overlap import COLLECTIVES
from modulec.ops.registry import collective_ops, op_table
from modulec.lower.build import BuildRequest, build
from tests.runtime_models import TINY

ROOT = Path(__file__).resolve().parent.parent


def tp_build(overlap: bool = True, sp: bool = False):
    path, settings = TINY["llama"]
    result = build(BuildRequest(ROOT / path, settings={k: str(v) for k, v in settings.items()},
                                shapes={"B": 2, "T": 6}, tensor_parallel=2,
                                sequence_parallel=sp, tp_overlap=overlap))
    assert not [d for d in result.diagnostics if d.is_error]
    return result


@pytest.fixture(scope="module")
def overlapped():
    return tp_build()


@pytest.mark.parametrize("sp, collective", [(False, "tp_copy_backward"),
                                            (True, "sp_all_gather_backward")])
def test_each_input_gradient_collective_runs_beside_the_weight_gradient(sp, collective):
    result = tp_build(sp=sp)
    graph = result.graph
    assert not verify_graph(graph)
    for name in ("CausalSelfAttention#1.backward", "SwiGLU_MLP#1.backward"):
        nodes = graph.function(name).nodes
        x, issued, weight, wait = nodes[-4:]  # the column matmul's backward comes last
        assert (x.target, tuple(map(bool, x.outputs))) == ("matmul_backward", (True, False))
        assert issued.target == collective and issued.attr(STREAM) == COMM
        assert issued.inputs == (x.outputs[0],)
        assert weight.id == f"{x.id}.weight" and weight.target == "matmul_backward"
        assert tuple(map(bool, weight.outputs)) == (False, True)
        assert weight.inputs == x.inputs and weight.attrs == x.attrs
        assert (wait.kind, wait.target, wait.inputs, wait.outputs) == (
            WAIT, issued.id, issued.outputs, ())
        function = graph.function(name)
        assert issued.outputs[0] in function.outputs  # joined before the function returns
        assert dict(function.param_grads)[_param(x)] == weight.outputs[1]
    # the row-parallel matmuls' backward reads an all-reduce's result: left whole
    mlp = graph.function("SwiGLU_MLP#1.backward")
    assert all(all(n.outputs) for n in mlp.nodes[:2] if n.target == "matmul_backward")
    section = result.document["schedule"]["tensor_parallel"]
    assert section["overlap"] is True


def _param(node: Node) -> str:
    return node.inputs[2][len("param:"):]


def test_the_wait_comes_before_the_first_reader(overlapped):
    """The LM head's input gradient is read by the final norm's backward: the weight
    gradient's GEMM runs while it is summed, then the wait, then the norm."""
    entry = overlapped.graph.function("Llama#1.backward")
    kinds = [(n.kind, n.target) for n in entry.nodes[:5]]
    assert kinds[:4] == [("op", "matmul_backward"), ("op", "tp_copy_backward"),
                         ("op", "matmul_backward"), (WAIT, entry.nodes[1].id)]
    assert entry.nodes[1].outputs[0] in entry.nodes[4].inputs


def test_no_tp_overlap_builds_the_collectives_in_order():
    result = tp_build(overlap=False)
    graph = result.graph
    assert not any(n.kind == WAIT or n.attr(STREAM) for f in graph.functions for n in f.nodes)
    assert all(all(n.outputs) for f in graph.functions for n in f.nodes
               if n.target == "matmul_backward")
    assert result.document["schedule"]["tensor_parallel"]["overlap"] is False


def test_the_schedule_and_the_printer_show_the_streams(overlapped):
    ops = overlapped.document["schedule"]["functions"]["CausalSelfAttention#1.backward"]
    by_node = {op["node"]: op for op in ops}
    function = overlapped.graph.function("CausalSelfAttention#1.backward")
    issued, wait = function.nodes[-3], function.nodes[-1]
    assert by_node[issued.id]["stream"] == 2 and by_node[wait.id]["stream"] == 0
    assert by_node[wait.id]["kernel"] == f"wait:{issued.id}"
    assert node_text(issued, function).endswith(" on comm")
    assert "stream=" not in node_text(issued, function)
    assert node_text(wait, function) == f"{wait.id}: wait {issued.id}({issued.outputs[0]})"
    from modulec.ir.verify_schedule import verify_schedule

    assert not verify_schedule(overlapped.document["schedule"], overlapped.graph)


def _broken(graph: Graph, name: str, edit) -> list[str]:
    function = graph.function(name)
    changed = replace(function, nodes=tuple(edit(list(function.nodes))))
    return verify_graph(replace(graph, functions=tuple(
        changed if f.name == name else f for f in graph.functions)))


def test_the_verifier_rejects_a_broken_issue_or_wait(overlapped):
    graph, name = overlapped.graph, "Llama#1.backward"
    no_wait = _broken(graph, name, lambda n: n[:3] + n[4:])
    assert any("no `wait b1` joins it" in p for p in no_wait), no_wait
    early = _broken(graph, name, lambda n: n[:3] + [n[4], n[3]] + n[5:])
    assert any("before `wait b1`: the collective making it may still be running" in p
               for p in early), early
    stray = _broken(graph, name, lambda n: n + [Node("w", WAIT, n[0].id, (n[0].outputs[0],),
                                                     ())])
    assert any("waits for no op issued before it" in p for p in stray), stray
    wrong = _broken(graph, name, lambda n: n[:3] + [replace(n[3], inputs=())] + n[4:])
    assert any("must list the outputs of b1" in p for p in wrong), wrong
    compute = _broken(graph, name, lambda n: [replace(n[0], attrs=n[0].attrs + (
        (STREAM, COMM),))] + n[1:])
    assert any("only a collective" in p for p in compute), compute
    other = _broken(graph, name, lambda n: n[:1] + [replace(n[1], attrs=tuple(
        (k, "copy" if k == STREAM else v) for k, v in n[1].attrs))] + n[2:])
    assert any("the only other stream is `comm`" in p for p in other), other


# ---------------------------------------------------------------------- the op table's collectives
def _issue_problems(target: str) -> list[str]:
    """What the verifier says of `b = target(a)` issued on the comm stream, joined at once."""
    value = lambda v: ValueInfo(v, ("4",), "bf16")  # noqa: E731
    nodes = (Node("n1", "op", target, ("a",), ("b",), ((STREAM, COMM),)),
             Node("n1.wait", WAIT, "n1", ("b",), ()))
    function = Function("F", "F", "F", (), (), (value("a"),), ("b",), (value("b"),), nodes)
    return [message for _, message in async_problems(function)]


def test_the_comm_stream_takes_the_op_tables_collectives():
    collectives = collective_ops()  # the primitives' `collective:` phases
    assert set(COLLECTIVES) <= collectives  # the pass issues only what the verifier takes
    for target in sorted(collectives):
        assert _issue_problems(target) == [], target
    for target in ("tp_copy", "sp_gather_backward", "matmul_backward"):  # no collective kernel
        (problem,) = _issue_problems(target)
        assert f"only a collective ({', '.join(sorted(collectives))}) runs there" in problem


def test_every_phase_running_a_collective_kernel_is_declared_one():
    """A phase whose kernel is one a declared collective runs (kernels.all_reduce, ...)
    is declared too: a new op reusing a collective kernel cannot be left off the list."""
    def kernel(target: str) -> str:
        return kernel_of(Node("n", "op", target, (), ()))

    kernels = {kernel(target) for target in collective_ops()}
    assert kernels and all(k.startswith("kernels.") for k in kernels), kernels
    for name, rule in op_table().items():
        for phase, target in (("forward", name), ("backward", f"{name}_backward")):
            assert (kernel(target) in kernels) == (phase in rule.collective), (name, phase)


# ---------------------------------------------------------------------- the planner
def _in_flight_graph(overlap: bool) -> Graph:
    """a = mul(x, x); b = all-reduce(a) [on comm]; c = mul(x, x); [wait]; y = add(b, c):
    without the wait's rule `a` dies at the collective and `c` may take its bytes."""
    value = lambda v: ValueInfo(v, ("64", "64"), "bf16")  # noqa: E731
    issued = Node("n1", "op", "tp_copy_backward", ("a",), ("b",),
                  ((STREAM, COMM),) if overlap else ())
    nodes = [Node("n0", "op", "mul", ("x", "x"), ("a",)), issued,
             Node("n2", "op", "mul", ("x", "x"), ("c",))]
    nodes += [Node("n1.wait", WAIT, "n1", ("b",), ())] if overlap else []
    nodes += [Node("n3", "op", "add", ("b", "c"), ("y",))]
    function = Function("F", "F", "F", (), (), (value("x"),), ("y",),
                        tuple(map(value, "abcy")), tuple(nodes))
    return Graph("F", "F", "", (function,))


def _bytes(placement) -> range:
    return range(placement.offset, placement.offset + placement.size_bytes)


@pytest.mark.parametrize("overlap", [False, True])
def test_the_planner_keeps_an_async_collectives_bytes_to_its_wait(overlap):
    from modulec.plan.from_graph import plan_step

    placed = plan_step(_in_flight_graph(overlap)).placements["F"]
    a, c = placed["a"], placed["c"]
    shared = bool(set(_bytes(a)) & set(_bytes(c)))
    assert shared is not overlap  # in order the input's bytes are free for `c`: reused
    if overlap:
        wait_index = 3
        assert a.last_use == wait_index and placed["b"].last_use >= wait_index


# ---------------------------------------------------------------------- the GPU step's
class Recording:
    """runtime/dist/streams.py's interface, recording each call (no CUDA)."""

    def __init__(self):
        self.calls, self.current = [], 0

    def record(self, stream, key):
        self.calls.append(("record", stream, key))

    def wait(self, stream, key):
        self.calls.append(("wait", stream, key))

    def on(self, stream):
        from contextlib import contextmanager

        @contextmanager
        def switched():
            before, self.current = self.current, stream
            yield
            self.current = before
        return switched()


def test_the_step_issues_on_comm_after_compute_and_joins_at_the_wait():
    torch = pytest.importorskip("torch")
    from runtime.cuda.async_comm import InFlight
    from runtime.interpreter import Frame

    graph = _in_flight_graph(True)
    function = graph.function("F")
    issued, wait = function.nodes[1], function.nodes[3]
    frame = Frame(function, "", ())
    frame.env["a"] = torch.ones(2)
    streams = Recording()
    ran_on, order = [], []
    a = frame.env["a"]

    def op(node, frame, forward):
        ran_on.append(streams.current)
        order.append("op")
        frame.env["b"] = frame.env["a"] * 2

    class Run:
        def _read(self, value, frame, forward):
            order.append(f"read {value}")
            return frame.env[value]

    flight = InFlight(streams)
    flight.issue(Run(), issued, frame, None, op)
    assert ran_on == [2] and flight.issued == 1 and len(flight.held) == 1
    # the inputs are read before the op is issued; it holds them and its output to the wait
    assert order == ["read a", "op"]
    held = flight.held[(id(frame), issued.id)]
    assert held[0] is a and held[1] is frame.env["b"]
    flight.wait(wait, frame)
    key = "tp:F/n1"
    assert streams.calls == [("record", 0, f"{key}:ready"), ("wait", 2, f"{key}:ready"),
                             ("record", 2, f"{key}:done"), ("wait", 0, f"{key}:done")]
    assert not flight.held
    with pytest.raises(RuntimeError, match="with no n1 issued"):
        flight.wait(wait, frame)


def test_the_cost_model_counts_each_half_once(overlapped):
    """The split halves cost what the whole node did: d_x's GEMM and d_W's, once each."""
    from modulec.plan.cost import node_cost, value_table

    off = tp_build(overlap=False).graph
    name = "SwiGLU_MLP#1.backward"
    whole = next(n for n in off.function(name).nodes if n.id == "b4")
    halves = [n for n in overlapped.graph.function(name).nodes if n.id in ("b4", "b4.weight")]
    before = node_cost(value_table(off, off.function(name)), whole)
    table = value_table(overlapped.graph, overlapped.graph.function(name))
    after = [node_cost(table, n) for n in halves]
    assert sum(c.flops for c in after) == before.flops > 0
    assert sorted(g for c in after for g in c.gemms) == sorted(before.gemms)


def test_the_step_interpreter_issues_every_async_collective_on_two_ranks(tmp_path):
    """On two gloo processes the GPU step's interpreter, issuing the tp_overlap program's
    collectives through InFlight (the CPU's in-order streams), gives the reference
    interpreter's logits, loss and gradients, and joins every op it issued: the
    backward issues one per column matmul run (2 a layer, 2 layers, and the LM head's)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("torch.multiprocessing")
    from tests import tp_workers
    from tests.dist_testing import free_port, spawn

    out = str(tmp_path / "rank")
    spawn(tp_workers.step_interpreter_rank, nprocs=2, args=(2, free_port(), out))
    for rank in range(2):
        got = torch.load(f"{out}.{rank}")
        assert got["waits"] == 3  # the attention's, the MLP's, the entry's
        assert got["issued"] == [0, 2 * 2 + 1] and got["held"] == [0, 0]
        for key in ("logits", "loss"):
            torch.testing.assert_close(got["got"][key], got["want"][key], rtol=0, atol=0)
        assert set(got["got"]["grads"]) == set(got["want"]["grads"])
        for path, grad in got["want"]["grads"].items():
            torch.testing.assert_close(got["got"]["grads"][path], grad, rtol=1e-12,
                                       atol=1e-14, msg=path)


def _train_args(tmp_path, file, *options) -> list:
    path, settings = TINY["llama"]
    tokens = tmp_path / "tokens.bin"
    tokens.write_bytes(bytes(2 * 200))  # uint16 zeros: train reads no sample here
    return ["train", str(file), "--data", str(tokens), "--seq", "6", "--batch", "2",
            "--steps", "1", "--device", "cpu", "--format", "json", *options]


def test_train_builds_with_no_tp_overlap(tmp_path, monkeypatch):
    """`modulec train --tp 2 --no-tp-overlap` builds its rank's program as `modulec build`
    does (the collectives in order); without --tp a usage error as in build."""
    from click.testing import CliRunner

    from modulec.cli import train_cmd
    from modulec.cli.main import modulec
    from runtime.train.run import Request, _model

    path, settings = TINY["llama"]
    sets = [a for k, v in settings.items() for a in ("--set", f"{k}={v}")]
    requests = []
    monkeypatch.setattr(train_cmd, "_run", lambda request: requests.append(request) or 0)
    for flags in (["--tp", "2", "--no-tp-overlap"], ["--tp", "2"]):
        result = CliRunner().invoke(modulec, _train_args(tmp_path, ROOT / path, *sets, *flags))
        assert result.exit_code == 0, result.output
    built = [_model(Request(**r), None).source.program(planned=False) for r in requests]
    assert [b.document["schedule"]["tensor_parallel"]["overlap"] for b in built] == [False, True]
    assert not any(n.kind == WAIT for f in built[0].graph.functions for n in f.nodes)
    alone = CliRunner().invoke(modulec, _train_args(tmp_path, ROOT / path, *sets,
                                                    "--no-tp-overlap"))
    assert alone.exit_code == 2 and "give --tp M" in alone.output and not requests[2:]


def test_train_refuses_no_tp_overlap_unlike_its_ir(tmp_path):
    """An IR document fixes the overlap: --no-tp-overlap on one built with it (or without
    --tp) is an error naming both, on one built with --no-tp-overlap it agrees."""
    from click.testing import CliRunner

    from modulec.cli.main import modulec
    from runtime.train.run import Request, document_parallel

    path, settings = TINY["llama"]
    sets = [a for k, v in settings.items() for a in ("--set", f"{k}={v}")]
    shapes = ["--shape", "B=2", "--shape", "T=6"]
    for name, flags, refusal in (("over.ir", ["--tp", "2"], "with the overlap"),
                                 ("one.ir", [], "without --tp")):
        built = CliRunner().invoke(modulec, ["build", str(ROOT / path), *sets, *shapes,
                                             *flags, "-o", str(tmp_path / name)])
        assert built.exit_code == 0, built.output
        result = CliRunner().invoke(modulec, _train_args(tmp_path, tmp_path / name,
                                                         "--init", "random",
                                                         "--no-tp-overlap"))
        assert result.exit_code == 1
        assert f"--no-tp-overlap: {tmp_path / name} was built {refusal}" in result.output
    built = CliRunner().invoke(modulec, ["build", str(ROOT / path), *sets, *shapes, "--tp",
                                         "2", "--no-tp-overlap", "-o", str(tmp_path / "in.ir")])
    assert built.exit_code == 0, built.output
    request = Request(tmp_path / "in.ir", tmp_path, 6, 2, 1, tp=None, no_tp_overlap=True)
    document_parallel(request)
    assert request.tp == 2
