"""Annotations on a value act where they are written: `@gradient(skip | scale= | clip=)`
on inputs, parameters and flow outputs (spec §7.8.3), in the reference runtime and under
`--verify-backward`; `@dtype(T)` on a flow output and on a parameter (§7.4.1)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from runtime.kernels import KERNELS  # noqa: E402
from runtime.model import Model  # noqa: E402
from tests.test_cli import run as run_cli  # noqa: E402

STOP_INSIDE = """\
module Inner(d: int = 4):
  params:
    w: [d, d]
  forward:
    in: (x: [B, d], m: [B, d] @gradient(skip))
    out: y: [B, d]
    graph:
      x -> matmul(w, transpose=NT) -> h
      (h, m) -> mul() -> y

model Outer(d: int = 4):
  params:
    inner: Inner(d)
  forward:
    in: x: [B, d]
    out: y: [B, d]
    graph:
      (x, x) -> inner -> a
      (a, x) -> add() -> y
"""

ANNOTATED = """\
model Scaled(d: int = 4):
  params:
    w: [d, d] {w}
  forward:
    in: (x: [B, d] {x})
    out: y: [B, d]
    graph:
      x -> matmul(w, transpose=NT) -> h {h}
      (h, x) -> mul() -> y
"""


def _write(tmp_path, text: str):
    path = tmp_path / "m.module"
    path.write_text(text, encoding="utf-8")
    return path


def _program(tmp_path, w="", x="", h=""):
    return _write(tmp_path, ANNOTATED.format(w=w, x=x, h=h))


def _gradients(path, seed=0):
    model = Model.from_module(path, dtype=torch.float64).init_random(seed, std=0.5)
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 4, generator=generator, dtype=torch.float64)
    model.forward(x=x)
    d_y = torch.randn(3, 4, generator=generator, dtype=torch.float64)
    grads = model.backward(y=d_y)
    return grads.inputs.get("x"), grads.params.get("w")


def test_a_stop_gradient_input_also_used_elsewhere_runs_and_verifies(tmp_path):
    result = run_cli("check", "--verify-backward", _write(tmp_path, STOP_INSIDE))
    assert result.exit_code == 0, result.output  # was exit 101: Tensor + NoneType
    assert "all gradients match" in result.output


def test_scale_on_an_input_scales_its_gradient(tmp_path):
    plain_x, plain_w = _gradients(_program(_mk(tmp_path / "a")))
    x, w = _gradients(_program(tmp_path, x="@gradient(scale=0.5)"))
    assert torch.allclose(x, 0.5 * plain_x)  # was 0: scale was lowered as skip
    assert torch.allclose(w, plain_w)


def test_scale_and_clip_on_a_parameter(tmp_path):
    plain_x, plain_w = _gradients(_program(_mk(tmp_path / "a")))
    x, w = _gradients(_program(tmp_path, w="@gradient(scale=2.0, clip=0.1)"))
    assert torch.equal(w, (2.0 * plain_w).clamp(-0.1, 0.1))  # was ignored
    assert torch.allclose(x, plain_x)


def test_skip_on_a_parameter_freezes_it(tmp_path):
    x, w = _gradients(_program(tmp_path, w="@gradient(skip)"))
    assert w is None and x is not None


def test_scale_on_a_flow_output_scales_what_flows_back_through_it(tmp_path):
    plain_x, plain_w = _gradients(_program(_mk(tmp_path / "a")))
    _, w = _gradients(_program(tmp_path, h="@gradient(scale=0.25)"))
    assert torch.allclose(w, 0.25 * plain_w)  # w is reached only through h


@pytest.mark.parametrize("notes", [dict(x="@gradient(scale=0.5)"),
                                   dict(w="@gradient(scale=0.5, clip=0.3)"),
                                   dict(h="@gradient(skip)", x="@gradient(clip=0.2)")])
def test_verify_backward_checks_annotated_gradients(tmp_path, notes):
    result = run_cli("check", "--verify-backward", _program(tmp_path, **notes))
    assert result.exit_code == 0, result.output


def test_verify_backward_catches_a_wrong_gradient_transform(tmp_path, monkeypatch):
    """The surrogates are no blank cheque: a scale_gradient backward that scales wrong,
    or that ignores its clip, fails."""
    kernel = KERNELS["scale_gradient"]
    wrong = lambda d_y, *, scale=1.0, clip=None, **_: [d_y * scale * 1.1]  # noqa: E731
    monkeypatch.setitem(KERNELS, "scale_gradient",
                        type(kernel)(**{**kernel.__dict__, "backward_fn": wrong}))
    for notes in (dict(x="@gradient(scale=0.5)"), dict(w="@gradient(clip=0.05)")):
        result = run_cli("check", "--verify-backward", _program(tmp_path, **notes))
        assert result.exit_code == 1, result.output


def _mk(folder):
    folder.mkdir(parents=True, exist_ok=True)
    return folder


CAST = """\
model Cast(d: int = 4):
  params:
    w: [d, d, bf16]
    v: [d, d] @dtype(fp32)
  forward:
    in: x: [B, d, bf16]
    out: y: [B, d]
    graph:
      x -> matmul(w, transpose=NT) -> a @dtype(fp32)
      a -> matmul(v, transpose=NT) -> y
"""


def test_dtype_on_a_flow_output_is_a_cast_where_written(tmp_path):
    result = run_cli("build", _write(tmp_path, CAST), "--emit", "graph")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    first = next(line for line in lines if "op matmul(x, param:w" in line)
    assert "[B, 4, bf16] = op matmul" in first  # the producer keeps its dtype
    assert any("[B, 4, fp32] = op cast(%1, dtype=fp32)" in line for line in lines)
    assert any("op matmul(%2, param:v" in line for line in lines)  # `a` is the cast


def test_dtype_runs_in_the_declared_dtypes(tmp_path):
    model = Model.from_module(_write(tmp_path, CAST), dtype=torch.bfloat16).init_random(0)
    assert model.params["v"].dtype == torch.float32  # was bf16: @dtype on a param ignored
    assert model.params["w"].dtype == torch.bfloat16
    x = torch.randn(2, 4, dtype=torch.bfloat16)
    y = model.forward(x=x)["y"]
    assert y.dtype == torch.float32
    a = (x.float() @ model.params["w"].float().T).to(torch.bfloat16).float()
    assert torch.allclose(y, a @ model.params["v"].T, atol=1e-5)
    grads = model.backward(y=torch.ones(2, 4))
    assert grads.inputs["x"].dtype == torch.bfloat16  # back through the cast
    assert grads.params["v"].dtype == torch.float32


NORMED = """\
model Normed(d: int = 8, v: int = 16):
  params:
    emb: [v, d]
    norm: [d] @dtype(fp32)
    w: [v, d]
  forward:
    in: token_ids: [B, T, int32]
    out: logits: [B, T, v]
    graph:
      token_ids -> embedding(emb) -> h
      h -> rmsnorm(norm, eps=1e-5) -> (n, _)
      n -> matmul(w, transpose=NT) -> logits
"""


def test_an_fp32_parameter_moves_no_activation_to_fp32(tmp_path):
    """`@dtype(fp32)` on a norm weight: the IR keeps the norm's output (and all after it)
    in the compute dtype, as the runtimes compute it (the first floating input's dtype),
    and the weight's gradient fp32 (was: the IR typed them fp32, the runtime made bf16)."""
    path = _write(tmp_path, NORMED)
    result = run_cli("build", path, "--shape", "B=2", "--shape", "T=4", "--emit", "graph")
    assert result.exit_code == 0, result.output
    ops = [line for line in result.output.splitlines() if "= op " in line]
    assert "%2: [2, 4, 8], %3: [2, 4, fp32] = op rmsnorm(%1, param:norm" in ops[1]
    assert ops[2].split(" = op")[0].endswith("[2, 4, 16]")  # logits: the compute dtype
    assert any("%g4: [8, fp32] = op rmsnorm_backward" in line for line in ops)
    model = Model.from_module(path, dtype=torch.bfloat16).init_random(0)
    assert model.params["norm"].dtype == torch.float32
    out = model.forward(token_ids=torch.zeros(2, 4, dtype=torch.int32))
    assert out["logits"].dtype == torch.bfloat16
    grads = model.backward(logits=torch.ones(2, 4, 16, dtype=torch.bfloat16))
    assert grads.params["norm"].dtype == torch.float32


def test_dtype_verifies_in_float64(tmp_path):
    result = run_cli("check", "--verify-backward", _write(tmp_path, CAST))
    assert result.exit_code == 0, result.output


def test_a_frozen_parameter_has_no_gradient_to_verify(tmp_path):
    result = run_cli("check", "--verify-backward", "--format", "json",
                     _program(tmp_path, w="@frozen"))
    assert result.exit_code == 0, result.output  # was: d_w FAIL (no gradient computed)
    assert '"gradient": "d_w", "max_rel_error": null, "ok": true, "note": "frozen"' \
        in result.output


SUBSCRIPTS = """\
model Last(d: int = 4, v: int = 5):
  params:
    w: [v, d]
  forward:
    in: x: [B, T, d]
    out: (y: [B, v], z: [B, 2, d])
    graph:
      x[:, -1] -> matmul(w, transpose=NT) -> y
      x[:, 1:3] -> z
"""


def test_subscripts_are_views_with_their_gradients(tmp_path):
    path = _write(tmp_path, SUBSCRIPTS)
    model = Model.from_module(path, dtype=torch.float64).init_random(0, std=0.5)
    x = torch.randn(2, 4, 4, dtype=torch.float64)
    out = model.forward(x=x)  # was: AttributeError in the runtime (a `[*]` node)
    assert torch.allclose(out["y"], x[:, -1] @ model.params["w"].T)
    assert torch.equal(out["z"], x[:, 1:3])
    d_y, d_z = torch.randn(2, 5, dtype=torch.float64), torch.randn(2, 2, 4, dtype=torch.float64)
    d_x = model.backward(y=d_y, z=d_z).inputs["x"]
    want = torch.zeros_like(x)
    want[:, -1] = d_y @ model.params["w"]
    want[:, 1:3] += d_z
    assert torch.allclose(d_x, want)
    result = run_cli("check", "--verify-backward", path)
    assert result.exit_code == 0, result.output
