"""The reference interpreter runs every std model and example forward and backward; its
backward (the IR's derived backward, run with the reference kernels' explicit backward
formulas) agrees with torch autograd through its own forward to float64 precision."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from runtime.errors import NonFiniteError, RuntimeUserError  # noqa: E402
from runtime.model import Model  # noqa: E402
from tests.runtime_models import TINY, token_inputs  # noqa: E402


def _model(name: str) -> Model:
    path, settings = TINY[name]
    return Model.from_module(path, settings=settings).init_random(0, std=0.3)


@pytest.mark.parametrize("name", sorted(TINY))
def test_backward_matches_autograd_of_the_forward(name):
    model = _model(name)
    inputs = token_inputs(model)
    params = list(model.params.values())
    for p in params:
        p.requires_grad_(True)
    outputs = model.forward(**inputs)
    seeds = {k: torch.randn_like(v) for k, v in outputs.items() if v.is_floating_point()}
    names = list(seeds)
    expected = torch.autograd.grad([outputs[n] for n in names], params,
                                   [seeds[n] for n in names], allow_unused=True)
    with torch.no_grad():
        model.forward(**inputs)
        grads = model.backward(**seeds).params
    assert set(grads) == {k for k, e in zip(model.params, expected) if e is not None}
    for (path, _), want in zip(model.params.items(), expected):
        if want is not None:
            error = (grads[path] - want).abs().max() / want.abs().max().clamp_min(1e-300)
            assert error < 1e-10, (path, float(error))


def test_parameters_are_keyed_by_path_per_layer():
    shapes = _model("llama").parameter_shapes()
    assert shapes["blocks[1].attention.qkv_weight"] == (64, 32)  # (4 + 2 + 2) heads x 8
    assert shapes["blocks[0].mlp.up_weight"] == (96, 32)
    assert shapes["final_norm.weight"] == (32,)
    assert "lm_head" not in _model("llama_tied").parameter_shapes()


def test_a_program_is_built_per_input_shape():
    model = _model("llama")
    a = model.forward(token_ids=torch.zeros(1, 4, dtype=torch.int32))["logits"]
    b = model.forward(token_ids=torch.zeros(3, 5, dtype=torch.int32))["logits"]
    assert a.shape == (1, 4, 64) and b.shape == (3, 5, 64)
    assert a.dtype == torch.float64


def test_input_errors_name_the_input_and_the_declaration():
    model = _model("llama")
    with pytest.raises(RuntimeUserError, match="input `token_ids` is missing"):
        model.forward()
    with pytest.raises(RuntimeUserError, match=r"shape \[4\], the model declares \[B, T\]"):
        model.forward(token_ids=torch.zeros(4, dtype=torch.int32))
    with pytest.raises(RuntimeUserError, match="unknown input"):
        model.forward(token_ids=torch.zeros(1, 4, dtype=torch.int32), ids=torch.zeros(1))


def test_conflicting_sizes_of_one_dim_are_an_error():
    model = Model.from_module(*TINY["example_gpt2"][:1], settings=TINY["example_gpt2"][1])
    with pytest.raises(RuntimeUserError, match="`T` is 5 here but 4"):
        model.forward(token_ids=torch.zeros(1, 4, dtype=torch.int32),
                      position_ids=torch.zeros(1, 5, dtype=torch.int32))


def test_a_missing_parameter_is_named():
    model = _model("llama")
    del model.params["blocks[1].mlp.down_weight"]
    with pytest.raises(RuntimeUserError, match=r"parameter `blocks\[1\].mlp.down_weight`"):
        model.forward(token_ids=torch.zeros(1, 4, dtype=torch.int32))


def test_a_non_finite_value_names_the_op_and_its_source_line():
    model = _model("llama")
    model.params["blocks[0].attention.qkv_weight"][0, 0] = float("inf")
    with pytest.raises(NonFiniteError) as failure:
        model.forward(token_ids=torch.zeros(1, 4, dtype=torch.int32))
    message = str(failure.value)
    assert "matmul" in message and "blocks[0].attention" in message
    assert "std/modules/attention.module:" in message


def test_backward_before_forward_is_an_error():
    with pytest.raises(RuntimeUserError, match="backward before forward"):
        _model("llama").backward()
