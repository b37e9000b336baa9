"""Hooks (spec §7.3.1 observe / modify / replace), `@probe` captures, `@trace` lines and
`@assert` checks in the reference runtime (runtime/hooks.py; docs/runtime.md)."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from runtime.errors import NonFiniteError, RuntimeUserError  # noqa: E402
from runtime.model import Model  # noqa: E402
from tests.runtime_models import TINY, token_inputs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# a 3-layer stack whose values carry probes, asserts and a trace
PROBED = '''"""Probes, assertions and a trace on a tiny stack."""

block Layer(d: int, bound: float):
  params:
    w: [d, d]

  forward:
    in: x: [B, d]
    out: [B, d]

    graph:
      x -> matmul(w, transpose=NT) -> h @probe("pre", capture=stats) @assert(!has_nan(h))
      h -> sigmoid() -> s @assert(max(s) <= bound, message="s too big") @probe("s_grad", capture=grad_stats)
      s -> silu() -> out @trace(level=tensors) @assert(out.shape[-1] == d)

model Probed(d: int = 4, n: int = 3, bound: float = 1.0):
  params:
    layers: [n] x Layer(d, bound)

  forward:
    in: x: [B, d]
    out: y: [B, d]

    graph:
      x -> layers -> y
'''


def _llama(**settings) -> Model:
    path, tiny = TINY["llama"]
    return Model.from_module(path, settings=tiny | settings).init_random(0, std=0.3)


@pytest.fixture
def probed(tmp_path):
    path = tmp_path / "probed.module"
    path.write_text(PROBED)

    def make(**settings):
        return Model.from_module(path, settings=settings).init_random(0, std=0.5)
    return make


X = torch.linspace(-1, 1, 8, dtype=torch.float64).reshape(2, 4)


# ====================================================================== hooks
def test_observe_sees_every_layer_with_its_index_and_scope():
    model, seen = _llama(), []
    model.hooks.observe("AfterMLPActivation", lambda t, ctx: seen.append((ctx, t.clone())))
    model.forward(**token_inputs(model))
    assert [c.layer for c, _ in seen] == [0, 1]
    assert [c.scope for c, _ in seen] == ["blocks[0].mlp", "blocks[1].mlp"]
    ctx = seen[0][0]
    assert (ctx.point, ctx.mode, ctx.name, ctx.op, ctx.phase) == \
        ("AfterMLPActivation", "observe", "hidden", "swiglu", "forward")
    assert ctx.span[0].endswith("std/modules/mlp.module") and ctx.indices == (0,)
    assert seen[0][1].shape == (2, 8, 48) and not torch.equal(seen[0][1], seen[1][1])


def test_hooks_on_a_call_and_outside_the_stack():
    model, seen = _llama(), []
    model.hooks.observe("AfterMLPDownProjection", lambda t, ctx: seen.append(ctx))
    model.hooks.observe("AfterEmbedding", lambda t, ctx: seen.append(ctx))
    model.forward(**token_inputs(model))
    assert [(c.point, c.layer, c.op) for c in seen] == [
        ("AfterEmbedding", None, "embedding"),
        ("AfterMLPDownProjection", 0, "SwiGLU_MLP#1"),
        ("AfterMLPDownProjection", 1, "SwiGLU_MLP#1")]


@pytest.mark.parametrize("layers, want", [(1, [1]), ([0, 1], [0, 1]), (range(1, 5), [1]),
                                          ([], [])])
def test_the_layers_filter(layers, want):
    model, seen = _llama(), []
    model.hooks.observe("AfterQKVProjection", lambda t, ctx: seen.append(ctx.layer), layers)
    model.forward(**token_inputs(model))
    assert seen == want


def test_a_removed_hook_is_not_called():
    model, seen = _llama(), []
    handle = model.hooks.observe("AfterAttention", lambda t, ctx: seen.append(ctx.layer))
    handle.remove()
    model.forward(**token_inputs(model))
    assert seen == []


def test_modify_zeroing_an_activation_equals_zeroing_the_down_weight():
    model, inputs = _llama(), token_inputs(_llama())
    model.hooks.modify("AfterMLPActivation", lambda t, ctx: torch.zeros_like(t), layers=1)
    hooked = model.forward(**inputs)["logits"]
    model.hooks.clear()
    plain = model.forward(**inputs)["logits"]
    model.params["blocks[1].mlp.down_weight"].zero_()
    zeroed = model.forward(**inputs)["logits"]
    assert torch.equal(hooked, zeroed) and not torch.allclose(hooked, plain)


def test_modify_in_place_is_the_same_as_returning_the_tensor():
    model, inputs = _llama(), token_inputs(_llama())
    model.hooks.modify("AfterQKVProjection", lambda t, ctx: t * 1.5)
    returned = model.forward(**inputs)["logits"]
    model.hooks.clear()
    model.hooks.modify("AfterQKVProjection", lambda t, ctx: t.mul_(1.5))
    assert torch.equal(model.forward(**inputs)["logits"], returned)


def _half_plus(t):
    return 0.5 * t + 0.25


@pytest.mark.parametrize("point", ["AfterMLPActivation",  # written backward, recomputed
                                   "AfterMLPUpProjection",  # written backward, recomputed
                                   "AfterQKVProjection",  # derived backward
                                   "AfterAttnOutProjection"])  # a call's output
def test_modify_is_straight_through_for_gradients(point):
    """The backward equals torch autograd through the forward with the hook written as
    `t + (f(t) - t).detach()`: the modified value is read downstream, its gradient passes
    to the op that made it unchanged."""
    model, inputs = _llama(), token_inputs(_llama())
    model.hooks.modify(point, lambda t, ctx: t + (_half_plus(t) - t).detach(), layers=1)
    params = list(model.params.values())
    for p in params:
        p.requires_grad_(True)
    logits = model.forward(**inputs)["logits"]
    seed = torch.randn_like(logits)
    expected = torch.autograd.grad(logits, params, seed, allow_unused=True)
    model.hooks.clear()
    model.hooks.modify(point, lambda t, ctx: _half_plus(t), layers=1)
    with torch.no_grad():
        assert torch.allclose(model.forward(**inputs)["logits"], logits)
        grads = model.backward(logits=seed).params
    for path, want in zip(model.params, expected):
        if want is not None:
            assert torch.allclose(grads[path], want, rtol=1e-10, atol=1e-12), path


def test_replace_substitutes_the_value_and_has_no_gradient():
    model, inputs = _llama(), token_inputs(_llama())
    model.hooks.modify("AfterMLPActivation", lambda t, ctx: t.flip(-1), layers=0)
    modified = model.forward(**inputs)["logits"]
    model.hooks.clear()
    model.hooks.replace("AfterMLPActivation", lambda t, ctx: t.flip(-1), layers=0)
    assert torch.equal(model.forward(**inputs)["logits"], modified)
    with pytest.raises(RuntimeUserError, match=r"`replace` hook substituted `hidden`.*"
                                               r"blocks\[0\]\.mlp.*AfterMLPActivation"):
        model.backward(logits=torch.ones_like(modified))
    model.hooks.clear()
    model.forward(**inputs)
    model.backward(logits=torch.ones_like(modified))  # no replace this time: fine


def test_what_hooks_may_return():
    model, inputs = _llama(), token_inputs(_llama())
    model.hooks.replace("AfterEmbedding", lambda t, ctx: None)
    with pytest.raises(RuntimeUserError, match="replace hook at AfterEmbedding .* returned "
                                               "nothing"):
        model.forward(**inputs)
    model.hooks.clear()
    model.hooks.modify("AfterEmbedding", lambda t, ctx: t[..., :4])
    with pytest.raises(RuntimeUserError, match=r"shape \[2, 8, 4\].*the value is \[2, 8, 32\]"):
        model.forward(**inputs)
    model.hooks.clear()
    model.hooks.observe("AfterEmbedding", lambda t, ctx: t.add_(1))
    with pytest.raises(RuntimeUserError, match="observe hook .* changed the tensor"):
        model.forward(**inputs)


def test_an_unknown_hook_point_lists_the_models_points():
    model = _llama()
    with pytest.raises(RuntimeUserError) as failure:
        model.hooks.observe("AfterMLPActivaton", print)
    assert "no hook point `AfterMLPActivaton`" in failure.value.message
    assert "did you mean `AfterMLPActivation`?" in failure.value.help
    listed = failure.value.help[-1]
    assert listed.startswith("hook points: ") and "AfterEmbedding" in listed
    assert "AfterQKVProjection" in listed and "BeforeLMHead" not in listed  # llama has none


# ====================================================================== probes
def test_annotations_arrive_on_the_producing_node(probed):
    graph = probed().source.program().graph
    layer = graph.function("Layer#1")
    notes = {n.target: dict(n.annotations) for n in layer.nodes}
    assert notes["matmul"]["probe"] == ('"pre"', "capture=stats", "on=h", "value=%1")
    assert notes["sigmoid"]["assert"][:2] == ("max(s) <= bound", 'message="s too big"')
    assert notes["silu"]["trace"] == ("level=tensors", "on=out", "value=%3")


def test_probes_capture_stats_per_layer_only_when_enabled(probed):
    model, values = probed(), {}
    model.forward(x=X)
    assert model.probes == {}  # disabled: nothing captured
    model.hooks.enable_probes()
    model.forward(x=X)
    assert sorted(model.probes) == [("pre", 0), ("pre", 1), ("pre", 2)]
    x = X
    for layer in range(3):
        w = model.params[f"layers[{layer}].w"]
        values[layer] = x @ w.T
        x = torch.nn.functional.silu(torch.sigmoid(values[layer]))
    for layer, h in values.items():
        record = model.hooks.get_probe("pre", layer)
        assert (record.layer, record.scope, record.value, record.phase, record.shape) == \
            (layer, f"layers[{layer}]", "h", "forward", (2, 4))
        assert record.mean == pytest.approx(float(h.mean()))
        assert record.std == pytest.approx(float(h.std()))
        assert record.min == pytest.approx(float(h.min()))
        assert record.max == pytest.approx(float(h.max()))
        assert record.absmax == pytest.approx(float(h.abs().max())) and record.nan == 0
        assert record.norm == pytest.approx(float(h.norm()))


def test_grad_stats_probes_capture_the_gradient_in_the_backward(probed):
    model = probed()
    model.hooks.enable_probes()
    kept = {}
    params = list(model.params.values())
    for p in params:
        p.requires_grad_(True)
    x = X
    for layer in range(3):  # autograd reference for d s
        s = torch.sigmoid(x @ model.params[f"layers[{layer}].w"].T)
        s.retain_grad()
        kept[layer] = s
        x = torch.nn.functional.silu(s)
    seed = torch.randn_like(x)
    x.backward(seed)
    with torch.no_grad():
        model.forward(x=X)
        assert ("s_grad", 0) not in model.probes  # captured in the backward
        model.backward(y=seed)
    for layer, s in kept.items():
        record = model.probes[("s_grad", layer)]
        assert (record.phase, record.value, record.capture) == ("backward", "d_s", "grad_stats")
        assert record.mean == pytest.approx(float(s.grad.mean()))
        assert record.absmax == pytest.approx(float(s.grad.abs().max()))


def test_probe_capture_modes_frequency_and_condition(tmp_path):
    path = tmp_path / "m.module"
    path.write_text(PROBED.replace('@probe("pre", capture=stats)',
                                   '@probe("pre", capture=full, frequency=2)')
                    .replace('@probe("s_grad", capture=grad_stats)',
                             '@probe("big", capture=histogram, condition="absmax(s) > 0.7")'))
    model = Model.from_module(path).init_random(0, std=0.5)
    model.hooks.enable_probes()
    model.forward(x=X)
    first = model.probes[("pre", 0)].tensor
    model.forward(x=2 * X)  # step 1: frequency 2 skips it
    assert torch.equal(model.probes[("pre", 0)].tensor, first)
    model.forward(x=2 * X)  # step 2
    assert torch.equal(model.probes[("pre", 0)].tensor, first * 2)
    counts, edges = model.probes[("big", 0)].histogram
    assert counts.sum() == 8 and edges.shape == (33,)
    captured = {layer for name, layer in model.probes if name == "big"}
    assert captured and captured != {0, 1, 2}  # only where absmax(s) > 0.7


# ====================================================================== trace
def test_trace_lines_go_to_the_stream_when_enabled(probed, capsys):
    model = probed()
    model.forward(x=X)
    assert capsys.readouterr().err == ""
    model.hooks.enable_trace()
    model.forward(x=X)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 3
    assert re.fullmatch(r"\[TRACE\] layers\[1\] silu: s=\[2, 4\] -> out=\[2, 4\]  "
                        r"\(.*probed\.module:14\)", lines[1])
    stream = io.StringIO()
    model.hooks.enable_trace(stream, level="values")
    model.forward(x=X)
    assert "out: float64 mean=" in stream.getvalue().splitlines()[0]
    model.hooks.enable_trace(stream, level="ops", all_ops=True)
    model.forward(x=X)
    assert "[TRACE] layers[0] sigmoid: h -> s" in stream.getvalue()
    model.hooks.disable_trace()
    model.forward(x=X)
    assert capsys.readouterr().err == ""


# ====================================================================== assertions
def test_assertions_pass_and_fail_with_the_value_op_and_line(probed):
    probed().forward(x=X)  # every assertion holds
    model = probed(bound=0.5)
    with pytest.raises(RuntimeUserError) as failure:
        model.forward(x=X)
    message = failure.value.message
    assert message.startswith("assertion `max(s) <= bound` failed: s too big")
    assert "`s` = sigmoid(...)" in message and "layers[0]" in message
    assert re.search(r"probed\.module:13:\d+", message)
    model.hooks.disable_assertions()
    model.forward(x=X)


def test_an_assertion_on_a_shape_and_on_finiteness(tmp_path):
    path = tmp_path / "m.module"
    path.write_text(PROBED.replace("out.shape[-1] == d", "out.shape == [B, d + 1]")
                    .replace("max(s) <= bound", "finite"))
    model = Model.from_module(path).init_random(0, std=0.5)
    with pytest.raises(RuntimeUserError, match=r"unknown name `B`"):
        model.forward(x=X)
    path.write_text(PROBED.replace("out.shape[-1] == d", "out.shape == [2, d + 1]"))
    model = Model.from_module(path).init_random(0, std=0.5)
    with pytest.raises(RuntimeUserError, match=r"assertion `out.shape == \[2, d \+ 1\]` "
                                               r"failed — on `out` = silu"):
        model.forward(x=X)
    model.check_finite = False
    path.write_text(PROBED)
    model = Model.from_module(path).init_random(0, std=0.5)
    model.check_finite = False
    model.params["layers[1].w"][0, 0] = float("nan")
    with pytest.raises(RuntimeUserError, match=r"`not has_nan\(h\)` failed — on `h` = "
                                               r"matmul.*layers\[1\]"):
        model.forward(x=X)


# ====================================================================== non-finite values
def test_a_non_finite_value_names_its_hook_point():
    model = _llama()
    model.params["blocks[1].mlp.up_weight"][0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match=r"`gate_up` \(%1\) = matmul\(...\) is not "
                                             r"finite .*blocks\[1\]\.mlp.*mlp\.module:\d+:.*"
                                             r"@hook\(AfterMLPUpProjection\)"):
        model.forward(**token_inputs(model))


def test_a_hook_writing_nan_is_caught_after_it():
    model = _llama()
    model.hooks.modify("AfterMLPActivation", lambda t, ctx: t.fill_(float("nan")), layers=1)
    with pytest.raises(NonFiniteError, match=r"`hidden` .* is not finite after its hooks "
                                             r".*@hook\(AfterMLPActivation\)"):
        model.forward(**token_inputs(model))


def test_a_non_finite_gradient_names_the_backward_op():
    model = _llama()
    logits = model.forward(**token_inputs(model))["logits"]
    seed = torch.zeros_like(logits)
    seed[0, 0, 0] = float("nan")
    with pytest.raises(NonFiniteError) as failure:
        model.backward(logits=seed)
    message = str(failure.value)
    assert "= matmul_backward(...) is not finite" in message
    assert "of `Llama#1.backward`" in message and "std/models/llama.module:" in message


# ====================================================================== the docs
def test_the_runtime_page_example_runs():
    page = (ROOT / "docs" / "runtime.md").read_text(encoding="utf-8")
    examples = re.findall(r"```python\n(.*?)```", page, re.S)
    assert len(examples) >= 2
    for example in examples:
        exec(compile(example, "docs/runtime.md", "exec"), {})
