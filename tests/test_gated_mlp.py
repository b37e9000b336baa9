"""SwiGLU in the GEMMs' epilogues (runtime/cuda/gated_mlp.py, gated_gemm.py): the step's
wiring on the CPU with the torch provider (the epilogues' math in fp32), against the
step's usual path and float32; the providers' math against autograd's SwiGLU; the
pattern found in the IR. The GPU run with quack's kernels: tests/test_cuda_gated_mlp.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from runtime.cuda import gated_gemm, gated_mlp  # noqa: E402
from runtime_models import token_inputs  # noqa: E402
from tests.test_lora_step import (_arena_step, _error, _laid_views, _lora_model,  # noqa: E402
                                  _reference_step)

BF16 = torch.bfloat16


def _draw(*shape, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(BF16)


def test_torch_provider_computes_swiglu_over_interleaved_columns():
    """act: gu interleaved (g0, u0, g1, ...) from W's [gate; up] rows, h = silu(g) * u;
    dact: d_g, d_u as autograd's SwiGLU gradient, interleaved; mm_rows_interleaved: the
    interleaved d_gu times W's rows taken in the same order."""
    gen = torch.Generator().manual_seed(0)
    rows, inner, ffn = 12, 16, 8
    a, w = _draw(rows, inner, gen=gen), _draw(2 * ffn, inner, gen=gen, scale=0.3)
    gu, h = torch.empty(rows, 2 * ffn, dtype=BF16), torch.empty(rows, ffn, dtype=BF16)
    prov = gated_gemm.TorchGated()
    prov.act(a, w, gu, h)
    plain = a.float() @ w.float().t()  # [gate | up]
    g, u = plain[:, :ffn], plain[:, ffn:]
    torch.testing.assert_close(gu, gated_gemm.interleaved(plain, 1).to(BF16))
    torch.testing.assert_close(h.float(), torch.nn.functional.silu(g) * u, rtol=1e-2,
                               atol=1e-2)
    d_y, b = _draw(rows, 6, gen=gen), _draw(6, ffn, gen=gen, scale=0.3)
    d_gu, h_again = torch.empty_like(gu), torch.empty_like(h)
    prov.dact(d_y, b, gu, d_gu, h_again)
    gate = gu[:, 0::2].float().requires_grad_()
    up = gu[:, 1::2].float().requires_grad_()
    d_h = d_y.float() @ b.float()
    (torch.nn.functional.silu(gate) * up).backward(d_h)
    torch.testing.assert_close(d_gu[:, 0::2].float(), gate.grad, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(d_gu[:, 1::2].float(), up.grad, rtol=1e-2, atol=1e-2)
    w_dx = _draw(2 * ffn, inner, gen=gen)
    out = torch.empty(rows, inner, dtype=BF16)
    prov.mm_rows_interleaved(d_gu, w_dx, out)
    blocked = torch.cat([d_gu[:, 0::2], d_gu[:, 1::2]], 1).float() @ w_dx.float()
    torch.testing.assert_close(out.float(), blocked, rtol=1e-2, atol=1e-2)


def test_interleaved_takes_the_halves_in_turn_and_deinterleaved_undoes_it():
    """Along either dim (the runtime's and bench_gated_gemm.py's one pair of helpers)."""
    t = torch.arange(12.).view(6, 2)
    assert gated_gemm.interleaved(t)[:, 0].tolist() == [0, 6, 2, 8, 4, 10]
    assert torch.equal(gated_gemm.deinterleaved(gated_gemm.interleaved(t)), t)
    t = torch.arange(6.).view(1, 6)
    assert gated_gemm.interleaved(t, 1)[0].tolist() == [0., 3., 1., 4., 2., 5.]
    assert torch.equal(gated_gemm.deinterleaved(gated_gemm.interleaved(t, 1), 1), t)


def test_interleaved_source_tells_gu_views_from_split_halves():
    gu = torch.arange(2 * 3 * 8, dtype=torch.float32).view(2, 3, 8)
    pairs = gu.view(2, 3, 4, 2)
    found = gated_mlp.interleaved_source(pairs[..., 0], pairs[..., 1])
    assert found is not None and torch.equal(found, gu.view(6, 8))
    assert gated_mlp.interleaved_source(gu[..., :4], gu[..., 4:]) is None  # a split's halves
    assert gated_mlp.interleaved_source(pairs[..., 1], pairs[..., 0]) is None  # swapped
    wide = torch.zeros(2, 3, 10)[..., :8].unflatten(-1, (4, 2))  # rows apart: not gu's bytes
    assert gated_mlp.interleaved_source(wide[..., 0], wide[..., 1]) is None


def test_the_pattern_is_each_layers_lora_swiglu_mlp():
    """sites: gate_up's one-GEMM add, split, swiglu; backward_sites: down's add, swiglu's
    and split's backward, gate/up's delta gradients and add, one site."""
    from runtime.cuda.lora_backward import lora_dx_pairs
    from runtime.cuda.lora_pairs import lora_addmm_pairs
    from runtime.interpreter import _saved_by_backward

    model = _lora_model(rank=8)
    graph = model.source.program_for(token_inputs(model)).graph
    mlp = graph.function("SwiGLU_MLP#1")
    found = gated_mlp.sites(graph, mlp, lora_addmm_pairs(mlp, _saved_by_backward(
        graph, mlp.name)))
    assert [(s.add.target, s.split.target, s.swiglu.target) for s in found.values()] == [
        ("add", "split", "swiglu")]
    back = graph.function("SwiGLU_MLP#1.backward")
    found = gated_mlp.backward_sites(back, lora_dx_pairs(back))
    targets = sorted(back.nodes[[n.id for n in back.nodes].index(i)].target for i in found)
    assert targets == ["add", "add", "matmul_backward", "split_backward", "swiglu_backward"]
    assert len({id(s) for s in found.values()}) == 1
    attention = graph.function("CausalSelfAttention#1")
    assert gated_mlp.sites(graph, attention, lora_addmm_pairs(attention)) == {}


def _laid_step(model, monkeypatch, switch: str, held: list, decisions=None):
    """One step on weights laid with side columns and tail rows, MODULEC_GATED_GEMM at
    `switch` (the slots are held in `held`: lora_kcat keeps weak references); `_arena_step`
undoes the monkeypatch when it returns."""
    import runtime.cuda.lora_kcat as kcat
    from modulec.lower.lora import is_adapter

    monkeypatch.setenv("MODULEC_GATED_GEMM", switch)
    monkeypatch.setenv("MODULEC_LORA_KCAT_MIN", "1.4")  # down's d_x one GEMM: 48 vs 32
    shapes = {p: tuple(t.shape) for p, t in model.params.items()}
    frozen = {p for p in shapes if not is_adapter(p)}
    views, slots = _laid_views(model, "cpu", kcat.side_columns(shapes, frozen),
                               kcat.tail_rows(shapes, frozen))
    held.append(slots)
    return _arena_step(model, monkeypatch, True, "cpu", params=views,
                       decisions=decisions)[:3]


def test_the_gated_step_computes_what_the_usual_step_does(monkeypatch):
    """Each layer's gate/up + swiglu forward, down's d_x + swiglu's backward, and gate/up's
    d_x over the interleaved d_gu run through the provider (here the torch one): every
    output and gradient as the usual path's within bf16's rounding, as near float32."""
    model = _lora_model(rank=8)
    held = []
    outputs, grads, run = _laid_step(model, monkeypatch, "torch", held)
    usual_outputs, usual_grads, usual = _laid_step(model, monkeypatch, "0", held)
    assert (run.gated_forward, run.gated_backward) == (2, 2)
    assert (usual.gated_forward, usual.gated_backward) == (0, 0)
    assert run.lora_dx_one_gemm == usual.lora_dx_one_gemm == 6
    assert run._gated_skip == set() and run._interleaved == set()
    assert "torch (" in gated_gemm.summary()  # the calls counted, for the step's notes
    exact_outputs, exact, _ = _reference_step(model)
    assert set(grads) == set(usual_grads) == set(exact)
    pairs = [*zip(outputs, usual_outputs, exact_outputs),
             *((grads[p], usual_grads[p], exact[p]) for p in exact)]
    new = [_error(got, want) for got, _, want in pairs]
    was = [_error(old, want) for _, old, want in pairs]
    assert max(new) < 0.1 and max(was) < 0.1, (new, was)
    assert sum(new) < 1.5 * sum(was), (sum(new), sum(was))
    for got, old in zip(outputs, usual_outputs):
        torch.testing.assert_close(got.float(), old.float(), rtol=0.05, atol=0.05)


def test_no_provider_no_gated_path(monkeypatch):
    """MODULEC_GATED_GEMM=0, or a CPU: the usual path, and `summary` says why."""
    monkeypatch.setattr(gated_gemm, "_used", gated_gemm.collections.Counter())
    monkeypatch.setattr(gated_gemm, "_why", {})
    monkeypatch.setattr(gated_gemm, "_chosen", {})
    assert gated_gemm.summary() is None  # no step asked
    monkeypatch.setenv("MODULEC_GATED_GEMM", "0")
    assert gated_gemm.provider(torch.device("cpu")) is None
    assert gated_gemm.summary() == "SwiGLU's gated GEMMs not run: MODULEC_GATED_GEMM=0"
    monkeypatch.setenv("MODULEC_GATED_GEMM", "1")
    assert gated_gemm.provider(torch.device("cpu")) is None
    assert "SM90" in gated_gemm.summary()


def test_a_provider_that_raises_hands_back_to_the_usual_path(monkeypatch, capfd):
    """A gated GEMM that raises (a layout its kernels refuse) turns the path off for the
    process, said once on stderr; where it raised at gate/up's d_x, after d_gu was written
    interleaved, d_gu is put back in order and the usual one GEMM runs: the step computes
    what the usual path does."""
    model = _lora_model(rank=8)
    held = []
    usual_outputs, usual_grads, _ = _laid_step(model, monkeypatch, "0", held)

    def refusing(*_):
        raise ValueError("no such layout")
    monkeypatch.setattr(gated_gemm, "_chosen", {})
    monkeypatch.setattr(gated_gemm.TorchGated, "mm_rows_interleaved", refusing)
    outputs, grads, run = _laid_step(model, monkeypatch, "torch", held)
    # both layers' forward; the last layer's down (gate/up's refused), the first's neither
    assert (run.gated_forward, run.gated_backward) == (2, 1)
    assert run._interleaved == set()
    assert capfd.readouterr().err.count("raised ValueError: no such layout") == 1
    for got, old in zip(outputs, usual_outputs):
        torch.testing.assert_close(got.float(), old.float(), rtol=0.05, atol=0.05)
    for path, old in usual_grads.items():
        assert _error(grads[path], old) < 0.1, path


def test_under_the_planners_decisions_the_gated_path_runs_where_nothing_is_dropped(
        monkeypatch):
    """With the planner's decisions present (none made: every value kept), the gated
    path still runs in both layers, bit for bit as without decisions."""
    from runtime.decisions import Decisions

    model = _lora_model(rank=8)
    held = []
    runs = [_laid_step(model, monkeypatch, "torch", held, decisions)
            for decisions in (None, Decisions())]
    (outputs, grads, free), (kept_outputs, kept_grads, decided) = runs
    assert (free.gated_forward, free.gated_backward) == (2, 2)
    assert (decided.gated_forward, decided.gated_backward) == (2, 2)
    assert all(torch.equal(a, b) for a, b in zip(outputs, kept_outputs))
    assert all(torch.equal(grads[p], kept_grads[p]) for p in grads)
