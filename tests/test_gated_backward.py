"""swiglu / geglu backward return y too (decisions.md, "Gated activations: the backward
returns y"): the reference kernel's (d_gate, d_up, y) are the forward's y and the
gradients' formulas bit for bit in float64; the std MLPs' written backwards take hidden
from it (no separate recompute node in the lowered IR); the derived backward leaves y
unwritten and the GPU step's kernel then skips it; FP8 still scales hidden as a forward
operand. The CUDA kernel's y: tests/test_cuda_kernels.py (`-m cuda`)."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from kernel_testing import F64, randn  # noqa: E402
from modulec.lower.build import BuildRequest, build  # noqa: E402
from runtime.kernels import KERNELS  # noqa: E402
from runtime.kernels.activations import gelu, gelu_grad  # noqa: E402
from runtime.kernels.base import silu, silu_grad  # noqa: E402

TINY = {"vocab_size": "64", "d_model": "32", "n_layers": "2", "num_heads": "4",
        "num_kv_heads": "2", "d_ff": "48"}
GATED = [("swiglu", {}), ("geglu", {"approximate": True}), ("geglu", {"approximate": False})]


def _activation(name, attrs):
    if name == "swiglu":
        return silu, silu_grad
    approximate = attrs["approximate"]
    return (lambda g: gelu(g, approximate)), (lambda g: gelu_grad(g, approximate))


# ====================================================================== the reference kernel
@pytest.mark.parametrize("name, attrs", GATED, ids=["swiglu", "geglu-tanh", "geglu-erf"])
def test_the_backward_returns_the_forwards_y_and_the_gradients_bit_for_bit(name, attrs):
    g = torch.Generator().manual_seed(11)
    d_y, gate, up = (randn(g, 3, 5, 24) * 3 for _ in range(3))
    kernel = KERNELS[name]
    d_gate, d_up, y = kernel.backward([d_y, gate, up], dict(attrs))
    (forward_y,) = kernel.forward([gate, up], dict(attrs))
    act, act_grad = _activation(name, attrs)
    assert y.dtype == F64 and torch.equal(y, forward_y)
    assert torch.equal(d_gate, d_y * up * act_grad(gate))
    assert torch.equal(d_up, d_y * act(gate))


@pytest.mark.parametrize("name, attrs", GATED, ids=["swiglu", "geglu-tanh", "geglu-erf"])
def test_in_bf16_the_backwards_y_is_the_forwards_rounding(name, attrs):
    """The same fp32 arithmetic, rounded once to bf16: the forward's bits."""
    g = torch.Generator().manual_seed(12)
    d_y, gate, up = (randn(g, 4, 40).to(torch.bfloat16) for _ in range(3))
    kernel = KERNELS[name]
    y = kernel.backward([d_y, gate, up], dict(attrs))[2]
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, kernel.forward([gate, up], dict(attrs))[0])


# ====================================================================== the lowered IR
def _backward_ops(path: str, module: str):
    graph = build(BuildRequest(Path(path), settings=TINY)).graph
    (function,) = [f for f in graph.functions if f.module == module and f.gradient_of]
    return function, [n for n in function.nodes if n.kind == "op"]


@pytest.mark.parametrize("path, module, op", [
    ("std/models/llama.module", "SwiGLU_MLP", "swiglu"),
    ("std/models/gemma.module", "GeGLU_MLP", "geglu")])
def test_the_std_mlp_backward_takes_hidden_from_its_activation_backward(path, module, op):
    function, ops = _backward_ops(path, module)
    targets = [n.target for n in ops]
    assert op not in targets  # no recompute pass over gate and up of its own
    (fused,) = [n for n in ops if n.target == f"{op}_backward"]
    d_gate, d_up, hidden = fused.outputs
    assert all((d_gate, d_up, hidden))
    # the down projection's weight gradient reads it, after the activation's backward
    readers = [n for n in ops if hidden in n.inputs]
    assert [(n.target, n.attr("transpose")) for n in readers] == [("matmul", "TN")]
    assert ops.index(readers[0]) > ops.index(fused)
    assert function.saved and hidden not in function.saved


def test_the_derived_backward_leaves_y_unwritten():
    graph = build(BuildRequest(Path("std/models/llama.module"), settings=TINY,
                               derive_written=True)).graph
    (function,) = [f for f in graph.functions if f.module == "SwiGLU_MLP" and f.gradient_of]
    (node,) = [n for n in function.nodes if n.target == "swiglu_backward"]
    assert node.outputs[0] and node.outputs[1] and node.outputs[2] == ""


def test_fp8_scales_the_backwards_hidden_as_a_forward_operand():
    """hidden comes out of an op that reads d_hidden, yet it is no gradient: the down
    projection's weight gradient quantizes it to the forward format, as when recomputed."""
    result = build(BuildRequest(Path("std/models/llama.module"), settings=TINY,
                                precision="fp8"))
    function, ops = _backward_ops("std/models/llama.module", "SwiGLU_MLP")
    (fused,) = [n for n in ops if n.target == "swiglu_backward"]
    (weight_grad,) = [n for n in ops if fused.outputs[2] in n.inputs]
    (site,) = [m for m in result.document["metadata"]["precision"]["matmuls"]
               if m["function"] == function.name and m["op"] == weight_grad.id]
    assert site["role"] == "backward" and site["operands"] == ["gradient", "forward"]


# ====================================================================== the GPU wrapper
class _Extension:
    """Records what the CUDA wrapper asks of the extension (no GPU here)."""

    def swiglu_backward(self, d_y, gate, up, out, activation, with_y):
        self.call = (len(out), activation, with_y)
        made = [torch.zeros_like(gate), torch.zeros_like(up)]
        return made + [torch.ones_like(gate)] if with_y else made


@pytest.mark.parametrize("attrs, with_y", [
    ({}, True),  # nothing said: y wanted
    ({"wanted_outputs": (True, True, True)}, True),
    ({"wanted_outputs": (True, True, False), "approximate": False}, False)])
def test_the_cuda_wrapper_asks_for_y_only_where_it_is_wanted(attrs, with_y):
    from runtime.cuda.kernels import _geglu_bwd

    ext, x = _Extension(), torch.zeros(2, 8)
    made = _geglu_bwd(ext, [x, x, x], attrs)
    activation = 2 if attrs.get("approximate") is False else 1
    assert ext.call == (3 if with_y else 2, activation, with_y)
    assert len(made) == 3 and (made[2] is not None) == with_y


@pytest.mark.parametrize("lora", [None, {"rank": 4, "alpha": 8}], ids=["written", "lora"])
def test_the_gpu_step_tells_a_derived_gated_backward_its_y_is_unwanted(lora):
    """LoRA derives the MLP's backward (its y unwritten: the kernel is told to skip it);
    the written one reads hidden from it (asked for all three, so told nothing)."""
    from runtime.cuda.step_interpreter import _StepInterpreter
    from runtime.cuda.train_kernels import train_kernels
    from runtime.model import Model
    from runtime_models import TINY as MODELS, token_inputs

    path, settings = MODELS["llama"]
    model = Model.from_module(path, settings=settings, dtype=torch.bfloat16, lora=lora)
    graph = model.source.program_for(token_inputs(model)).graph
    run = _StepInterpreter(graph, model.params, torch.bfloat16, check_finite=False,
                           kernels=train_kernels("cpu"))
    (node,) = [n for f in graph.functions for n in f.nodes if n.target == "swiglu_backward"]
    asked = run._attrs(node).get("wanted_outputs")
    assert asked == ((True, True, False) if lora else None)


# ====================================================================== written backwards
SPEC_FORM = '''
module GatedMLP(d_model: int, d_ff: int):
  params:
    up_weight: [2 * d_ff, d_model]
    down_weight: [d_model, d_ff]

  forward:
    in: x: [B, T, d_model]
    out: [B, T, d_model]
    graph:
      x -> matmul(up_weight, transpose=NT) -> gate_up
      gate_up -> split([d_ff, d_ff], dim=-1) -> (gate, up)
      (gate, up) -> swiglu() -> hidden
      hidden -> matmul(down_weight, transpose=NT) -> out
    save: [x, gate, up]
    recompute: [hidden]

  backward:
    graph:
      recompute:
        (saved.gate, saved.up) -> swiglu() -> hidden
      (d_out, down_weight) -> matmul(transpose=NN) -> d_hidden
      (d_out, hidden) -> matmul(transpose=TN) -> d_down_weight
      (d_hidden, saved.gate, saved.up) -> swiglu_backward() -> (d_gate, d_up)
      (d_gate, d_up) -> concat(dim=-1) -> d_gate_up
      (d_gate_up, up_weight) -> matmul(transpose=NN) -> d_x
      (d_gate_up, saved.x) -> matmul(transpose=TN) -> d_up_weight

model M(d_model: int = 32, d_ff: int = 48):
  params:
    mlp: GatedMLP(d_model, d_ff)
  forward:
    in: x: [B, T, d_model]
    out: [B, T, d_model]
    graph:
      x -> mlp -> out
'''


def test_a_written_backward_may_name_only_the_gradients(tmp_path):
    """Spec §6.3.1's form, `swiglu_backward() -> (d_gate, d_up)`: the backward's trailing
    non-gradient output (y) may go unnamed, so user backwards written that way still
    check, build and verify against the derived backward; naming too few gradients is
    still E003."""
    from tests.test_cli import run  # the CLI in-process: a Python start costs more

    path = tmp_path / "spec_form.module"
    path.write_text(SPEC_FORM)
    done = run("check", path, "--verify-backward")
    assert done.exit_code == 0, done.output
    assert "all gradients match" in done.output
    built = run("build", path, "-o", tmp_path / "m.ir")
    assert built.exit_code == 0, built.output
    path.write_text(SPEC_FORM.replace("swiglu_backward() -> (d_gate, d_up)",
                                      "swiglu_backward() -> d_gate"))
    short = run("check", path)
    assert short.exit_code == 1 and "E003" in short.output
