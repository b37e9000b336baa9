"""Running on the memory plan (runtime.arena): every std model and example gives bitwise
the results of the plain run (bf16, the plan's dtypes) with each activation region one
buffer and every value at its planned offset; the backward reads nothing of the forward's
transient bytes; and a plan that lets two live values share bytes is caught."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from modulec.plan.memory import SAVED, TRANSIENT  # noqa: E402
from runtime.model import Model  # noqa: E402
from tests.runtime_models import TINY, token_inputs  # noqa: E402


def _run(name: str, arena: bool, poison: bool = False, tamper=None):
    path, settings = TINY[name]
    model = Model.from_module(path, settings=settings, dtype=torch.bfloat16)
    model.init_random(0, std=0.3)
    model.arena = arena
    inputs = token_inputs(model)
    program = model.source.program_for(inputs)
    model.program = program
    if tamper is not None:
        tamper(model._arena())
    outputs = model.forward(**inputs)
    if poison:  # NaN everywhere in the transient bytes: the backward must not read them
        model._arena().regions[TRANSIENT].fill_(255)
    seeds = {k: torch.full_like(v, 0.01) for k, v in outputs.items() if v.is_floating_point()}
    return outputs, model.backward(**seeds).params, model


def _same(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", sorted(TINY))
def test_the_arena_run_is_the_plain_run_bit_for_bit(name):
    plain_out, plain_grads, _ = _run(name, arena=False)
    out, grads, model = _run(name, arena=True, poison=True)
    assert _same(plain_out, out) and _same(plain_grads, grads)
    sizes = model._arena().bytes_of()
    assert sizes[SAVED] > 0 and sizes[TRANSIENT] > 0
    regions = model._param_regions()  # weights and gradients: one buffer each
    for tensors, region in ((model.params, regions.weights), (grads, regions.gradients)):
        low, high = region.data_ptr(), region.data_ptr() + region.numel()
        assert all(low <= t.data_ptr() < high for t in tensors.values())


def test_a_plan_that_overlaps_live_values_changes_the_results():
    def overlap(arena):  # the block's second saved value onto its first, in every run
        placed = arena.placements["DenseTransformerBlock#1"]
        first, second = [v for v, p in sorted(placed.items(), key=lambda kv: kv[1].offset)
                         if p.region == SAVED and p.block == v][:2]
        for _, blocks in arena.records["DenseTransformerBlock#1"]:
            blocks[second] = blocks[first]
    _, plain_grads, _ = _run("llama", arena=False)
    _, grads, _ = _run("llama", arena=True, tamper=overlap)
    assert not _same(plain_grads, grads)


def test_a_value_larger_than_its_bytes_is_refused():
    from runtime.errors import RuntimeUserError

    path, settings = TINY["llama"]
    model = Model.from_module(path, settings=settings, dtype=torch.float64)
    model.init_random(0)
    model.arena = True
    with pytest.raises(RuntimeUserError, match="the plan gives it"):
        model.forward(**token_inputs(model))


def _train_kernel_run(name: str, arena: bool, derive_written: bool = False, own=False):
    """The GPU step's interpreter and kernels (their CPU paths: views stay views, RoPE is
    planned in place) with the LM head cut off, on the arena or not (`derive_written`:
    the backward derived, not the source's; `own`: as the GPU step makes its arena, the
    saved values of kernels that allocate their outputs in their own bytes)."""
    from runtime.arena import Arena, ParameterRegions
    from runtime.cuda.lm_head import split_head
    from runtime.cuda.step import _StepInterpreter
    from runtime.cuda.train_kernels import allocating_ops, train_kernels

    path, settings = TINY[name]
    model = Model.from_module(path, settings=settings, dtype=torch.bfloat16)
    model.init_random(0, std=0.3)
    model.source.derive_written = derive_written
    inputs = token_inputs(model)
    program = model.source.program_for(inputs)
    split = split_head(program.graph)
    graph = split.graph if split else program.graph
    options = {}
    if arena:
        layout = program.document.get("schedule", {}).get("layout", {})
        regions = ParameterRegions.for_params(model.params)
        own_bytes = allocating_ops(train_kernels("cpu")) if own else frozenset()
        options = {"arena": Arena(graph, layout, own_bytes=own_bytes), "param_regions": regions}
    params = options["param_regions"].bind(model.params) if arena else model.params
    run = _StepInterpreter(graph, params, torch.bfloat16, check_finite=False,
                           kernels=train_kernels("cpu"), keep_only_saved=True, **options)
    outputs, frame = run.forward([inputs[n] for n in program.input_names()])
    seeds = [torch.full_like(o, 0.01) if o.is_floating_point() else None for o in outputs]
    return outputs, run.backward(frame, seeds)[1]


@pytest.mark.parametrize("name", sorted(TINY))
def test_the_training_kernels_on_the_arena_give_the_plain_run(name):
    """Views (q, k, v of the fused projection) stay views of the arena's bytes, and an
    in-place RoPE writes into them where they are, strided (a split part on the head dim
    is not the dense range its placement reads as)."""
    plain_out, plain_grads = _train_kernel_run(name, arena=False)
    out, grads = _train_kernel_run(name, arena=True)
    assert all(torch.equal(a, b) for a, b in zip(plain_out, out))
    assert _same(plain_grads, grads)


def test_matmuls_write_into_their_planned_bytes(monkeypatch):
    """On the arena, each matmul output and input gradient is computed into its planned
    bytes (cuBLAS / torch `mm(out=)`), so place() finds it there and copies nothing."""
    import runtime.cuda.train_kernels as train

    written, copied = [], []
    product_into = train.product_into
    monkeypatch.setattr(train, "product_into",
                        lambda *a: written.append(product_into(*a)) or written[-1])
    monkeypatch.setattr(torch.Tensor, "copy_", _recording(torch.Tensor.copy_, copied))
    _train_kernel_run("llama", arena=True)
    assert written and all(t is not None for t in written)
    assert not any(src is w for src in copied for w in written)


def _recording(copy, into: list):
    def recorded(self, src, *args, **kwargs):
        into.append(src)
        return copy(self, src, *args, **kwargs)
    return recorded


def test_call_results_are_written_into_the_callers_bytes(monkeypatch):
    """The attention's and MLP's results (matmuls, forward and backward) and the block
    backward's are computed straight into the bytes the caller's plan holds for the
    call's outputs: handing them over moves nothing."""
    from runtime.arena import Arena

    moved = {}
    hand_over = Arena.hand_over

    def recording(self, parent, node, child, values, remaining):
        results = hand_over(self, parent, node, child, values, remaining)
        for value, before, after in zip(child.function.outputs, values, results):
            if value in self.handed.get(child.function.name, {}):
                moved.setdefault(child.function.name, []).append(
                    before.data_ptr() != after.data_ptr())
        return results
    monkeypatch.setattr(Arena, "hand_over", recording)
    _train_kernel_run("llama", arena=True)
    callees = [name for name in moved if name.startswith(("SwiGLU_MLP", "CausalSelfAttention"))]
    assert len(callees) == 4
    assert not any(any(moved[name]) for name in callees)
    # the block's backward returns one tensor for d_x and d_residual (twins): one buffer
    # of the caller holds both, handing them over moves neither
    assert moved["DenseTransformerBlock#1.backward"] == [False] * 4


@pytest.mark.parametrize("derived", [False, True])
def test_concats_planned_in_place_move_nothing(monkeypatch, derived):
    """The MLP's (d_gate, d_up) and the attention's (d_q, d_k, d_v) are made in the bytes
    of the concat (written backward) or split backward (derived) that joins them
    (modulec.plan.joins): the join is a view of them, nothing is copied there."""
    from modulec.plan.joins import CONCATS
    from runtime.arena import Arena

    joined = []
    place = Arena.place

    def recording(self, frame, node, value, tensor):
        placed = place(self, frame, node, value, tensor)
        if node is not None and node.target in CONCATS:
            joined.append(placed.data_ptr() == tensor.data_ptr())
        return placed
    monkeypatch.setattr(Arena, "place", recording)
    _train_kernel_run("llama", arena=True, derive_written=derived)
    assert len(joined) == 4 and all(joined)  # two layers, MLP and attention


def test_transient_outputs_of_an_allocating_kernel_stay_where_it_made_them(monkeypatch):
    """The GPU attention allocates its outputs (`allocates_outputs`): on the arena its
    backward's transient d_q and d_k are read where the kernel made them (nothing copied
    into their planned bytes), while d_v, a part of the planned d_qkv, is moved there; the
    forward's saved output and log-sum-exp go to their records."""
    from runtime.arena import Arena

    placed = []
    place = Arena.place

    def recording(self, frame, node, value, tensor):
        placed.append((node.target if node is not None else None, value))
        return place(self, frame, node, value, tensor)
    monkeypatch.setattr(Arena, "place", recording)
    _train_kernel_run("llama", arena=True, derive_written=True)
    backward = [v for target, v in placed if target == "flash_attention_backward"]
    forward = [v for target, v in placed if target == "flash_attention"]
    assert len(backward) == 2 and len(forward) == 4  # two layers: d_v; out and lse


def test_saved_values_of_allocating_kernels_keep_their_bytes(monkeypatch):
    """As the GPU step makes its arena (`own_bytes`): the saved values that the grouped
    GEMM, the MoE gathers and attention make (`allocates_outputs`, no `out=`) are not
    copied into records, which hold no bytes for them (the saved region shrinks by those
    bytes); the results are the plain run's bit for bit."""
    import runtime.arena as arena_module

    copied, sizes = [], {}
    moved, init = arena_module._moved, arena_module.Arena.__post_init__

    def recording(target, tensor):
        if target.data_ptr() != tensor.data_ptr():
            copied.append(tuple(tensor.shape))
        return moved(target, tensor)

    def made(self):
        init(self)
        sizes[bool(self.own_bytes)] = self.bytes_of()[SAVED]
    monkeypatch.setattr(arena_module, "_moved", recording)
    monkeypatch.setattr(arena_module.Arena, "__post_init__", made)
    _train_kernel_run("mixtral", arena=True)
    before, copied[:] = list(copied), []
    plain_out, plain_grads = _train_kernel_run("mixtral", arena=False)
    out, grads = _train_kernel_run("mixtral", arena=True, own=True)
    assert all(torch.equal(a, b) for a, b in zip(plain_out, out))
    assert _same(plain_grads, grads)
    gate_up = (32, 96)  # 16 tokens x top-2 routed rows, 2 x d_ff 48: the largest saved value
    assert before.count(gate_up) == 2 and gate_up not in copied  # 2 layers
    assert len(before) - len(copied) == 2 * 6  # permuted, scatter, gate_up, expert_out,
    # attention's out and lse: per layer
    assert (32, 32) not in copied  # routed rows of d_model (d_rows, d_x too: transients)
    assert sizes[True] < sizes[False]


def _budgeted_run(program, params, arena: bool, frame_events=None):
    """The GPU step's interpreter (CPU kernels) on a budgeted program's decisions."""
    from runtime.arena import Arena, ParameterRegions
    from runtime.cuda.lm_head import split_head
    from runtime.cuda.step import _StepInterpreter
    from runtime.cuda.train_kernels import train_kernels
    from runtime.decisions import Decisions

    graph = split_head(program.graph).graph
    options = {}
    if arena:
        layout = program.document["schedule"]["layout"]
        options = {"arena": Arena(graph, layout), "param_regions": ParameterRegions.for_params(params)}
        params = options["param_regions"].bind(params)
    run = _StepInterpreter(graph, params, torch.bfloat16, check_finite=False,
                           kernels=train_kernels("cpu"), keep_only_saved=True,
                           decisions=Decisions.from_schedule(program.document["schedule"]),
                           frame_events=frame_events, **options)
    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0),
                           dtype=torch.int32)
    outputs, frame = run.forward([tokens])
    seeds = [torch.full_like(o, 0.01) for o in outputs]
    return run.backward(frame, seeds)[1], options.get("arena")


def _budgeted_program():
    """Tiny Llama (3 layers) planned to 5% above its lowest peak (h200-noswap: recompute)."""
    from pathlib import Path

    from modulec.lower.build_plan import PlanOptions
    from modulec.plan.budget import make_problem, no_recompute, plan_budget
    from modulec.plan.devices import device
    from runtime.inputs import sized_inputs
    from runtime.model import parameter_shapes
    from runtime.program import ModuleSource

    settings = {"n_layers": "3", "d_model": "64", "num_heads": "4", "num_kv_heads": "2",
                "d_ff": "128", "vocab_size": "128", "max_seq": "64"}
    path = Path(__file__).resolve().parents[1] / "std" / "models" / "llama.module"
    plain = ModuleSource(path, settings, derive_written=True)
    tokens = sized_inputs(plain.program(planned=False).input_names(), 2, 32)
    problem = make_problem(plain.program_for(tokens).graph, None, "full", device("h200-noswap"))
    lowest = plan_budget(problem, 0).minimum_peak
    budget = int(lowest + 0.05 * (no_recompute(problem).peak_bytes - lowest))
    program = ModuleSource(path, settings, derive_written=True, planning=PlanOptions(
        budget=budget, device="h200-noswap")).program_for(tokens)
    g = torch.Generator().manual_seed(1)
    params = {p: (0.3 * torch.randn(s, generator=g)).to(torch.bfloat16)
              for p, s in parameter_shapes(program.graph).items()}
    return program, params


def test_budgeted_runs_tell_zero3_when_each_function_run_starts():
    """With recompute decisions the GPU step's interpreter runs a forward function itself:
    it still reports each layer's and the entry's forward and backward (ZeRO-3 gathers
    weights there; it missed the forward ones)."""
    class Events:
        def __init__(self):
            self.seen = []

        def frame_begin(self, path, backward):
            self.seen.append((path, backward))

    program, params = _budgeted_program()
    events = Events()
    _budgeted_run(program, params, arena=False, frame_events=events)
    layers = [f"blocks[{i}]" for i in range(3)]
    seen = [(path, backward) for path, backward in events.seen if path in ["", *layers]]
    assert seen == [("", False)] + [(p, False) for p in layers] + [("", True)] + \
        [(p, True) for p in reversed(layers)]


def test_budgeted_replays_write_into_the_saved_bytes_of_later_runs(monkeypatch):
    """With a memory budget (h200-noswap: recompute only), a matmul of layer i whose
    result its own record does not keep writes into the records of layers > i: in the
    forward (not written yet; released when layer i returns) and replayed in the backward
    (their backward is done). The same gradients as the step on torch's allocator, bit
    for bit."""
    from runtime.arena import Arena

    program, params = _budgeted_program()
    given = []
    replay_bytes = Arena.replay_bytes
    monkeypatch.setattr(Arena, "replay_bytes",
                        lambda *a: given.append(replay_bytes(*a)) or given[-1])
    want, _ = _budgeted_run(program, dict(params), arena=False)
    got, arena = _budgeted_run(program, dict(params), arena=True)
    assert any(b is not None for b in given)
    saved = arena.regions[SAVED]
    assert all(saved.data_ptr() <= b.data_ptr() < saved.data_ptr() + saved.numel()
               for b in given if b is not None)
    assert _same(want, got)
