"""`modulec run`: inputs and seeds by name in, outputs and HF-named gradients out, and a
clear error (exit 1, no traceback) for each user mistake."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from tests.runtime_models import DENSE  # noqa: E402
from tests.test_cli import run  # noqa: E402

LLAMA = "std/models/llama.module"
SETTINGS = [a for k, v in DENSE.items() for a in ("--set", f"{k}={v}")]


def _inputs(tmp_path, **tensors):
    path = tmp_path / "in.safetensors"
    safetensors_torch.save_file(tensors, str(path))
    return path


def _ids():
    return torch.randint(0, 64, (2, 5), dtype=torch.int32)


def test_forward_and_backward_with_random_weights(tmp_path):
    inputs = _inputs(tmp_path, token_ids=_ids(), d_logits=torch.randn(2, 5, 64,
                                                                      dtype=torch.float64))
    out = tmp_path / "out.safetensors"
    result = run("run", LLAMA, *SETTINGS, "--random-weights", "0", "--inputs", inputs,
                 "--outputs", out, "--backward")
    assert result.exit_code == 0, result.output
    written = safetensors_torch.load_file(str(out))
    assert written["logits"].shape == (2, 5, 64) and written["logits"].dtype == torch.float64
    assert "grad.blocks[1].attention.qkv_weight" in written  # no checkpoint: by path


def test_dtype_float32(tmp_path):
    out = tmp_path / "out.safetensors"
    result = run("run", LLAMA, *SETTINGS, "--random-weights", "0", "--dtype", "float32",
                 "--inputs", _inputs(tmp_path, token_ids=_ids()), "--outputs", out)
    assert result.exit_code == 0, result.output
    assert safetensors_torch.load_file(str(out))["logits"].dtype == torch.float32


@pytest.mark.parametrize("tensors, extra, message", [
    ({}, [], "input `token_ids` is missing"),
    ({"token_ids": None, "ids": None}, [], "not inputs: ids"),
    ({"token_ids": None}, ["--backward"], "missing d_logits"),
])
def test_mistakes_are_reported_without_traceback(tmp_path, tensors, extra, message):
    values = {k: _ids() for k in tensors} or {"other": _ids()}
    if not tensors:
        values = {"unrelated": _ids()}
    result = run("run", LLAMA, *SETTINGS, "--random-weights", "0", "--outputs",
                 tmp_path / "o.safetensors", "--inputs", _inputs(tmp_path, **values), *extra)
    assert result.exit_code == 1
    assert message in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("ids, message", [
    (torch.tensor([[1, 64]], dtype=torch.int32), "has token id 64; ids must be in 0 .. 63"),
    (torch.tensor([[-1, 2]], dtype=torch.int64), "has token id -1"),
    (torch.zeros((1, 0), dtype=torch.int32), "has shape [1, 0]"),
    (torch.zeros((1, 3), dtype=torch.float32), "is torch.float32: token ids are integers"),
    (torch.zeros((1, 65), dtype=torch.int32), "T = 65, above the model's max_seq (64)"),
])
def test_bad_token_ids_are_refused_before_running(tmp_path, ids, message):
    result = run("run", LLAMA, *SETTINGS, "--random-weights", "0", "--outputs",
                 tmp_path / "o.safetensors", "--inputs", _inputs(tmp_path, token_ids=ids))
    assert result.exit_code == 1, result.output
    assert message in result.output and "Traceback" not in result.output


def test_weights_are_required(tmp_path):
    result = run("run", LLAMA, "--inputs", _inputs(tmp_path, token_ids=_ids()),
                 "--outputs", tmp_path / "o.safetensors")
    assert result.exit_code == 1 and "--hf-weights DIR or --random-weights" in result.output


def test_an_ir_document_runs_like_its_module(tmp_path):
    ir = tmp_path / "llama.ir"
    assert run("build", LLAMA, *SETTINGS, "--shape", "B=2", "--shape", "T=5",
               "-o", ir).exit_code == 0
    inputs = _inputs(tmp_path, token_ids=_ids())
    outs = [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    for source, out in zip([LLAMA, ir], outs):
        extra = SETTINGS if source == LLAMA else []
        result = run("run", source, *extra, "--random-weights", "3", "--inputs", inputs,
                     "--outputs", out)
        assert result.exit_code == 0, result.output
    a, b = (safetensors_torch.load_file(str(o))["logits"] for o in outs)
    assert torch.equal(a, b)


def test_an_ir_document_refuses_other_sizes(tmp_path):
    ir = tmp_path / "llama.ir"
    run("build", LLAMA, *SETTINGS, "--shape", "B=2", "--shape", "T=5", "-o", ir)
    inputs = _inputs(tmp_path, token_ids=torch.zeros(2, 6, dtype=torch.int32))
    result = run("run", ir, "--random-weights", "0", "--inputs", inputs, "--outputs",
                 tmp_path / "o.safetensors")
    assert result.exit_code == 1 and "was built for [2, 5]" in result.output


def test_an_ir_document_built_without_sizes_is_refused(tmp_path):
    """Its op attributes keep the symbols (zeros(shape=[B, T, d])): run and train exited
    101 in the first op that read one."""
    ir = tmp_path / "llama.ir"
    assert run("build", LLAMA, *SETTINGS, "-o", ir).exit_code == 0
    inputs = _inputs(tmp_path, token_ids=_ids())
    result = run("run", ir, "--random-weights", "0", "--inputs", inputs, "--outputs",
                 tmp_path / "o.safetensors")
    assert result.exit_code == 1, result.output
    assert "was built without sizes for B, T" in result.output
    assert "--shape B=N --shape T=N" in result.output


# ====================================================================== inline calls (issue 15)
INLINE = """
module Double():
  forward:
    in: x: [B, T, 16]
    out: y: [B, T, 16]

    graph:
      (x, x) -> add() -> y


model Tiny(vocab: int = 64, d: int = 16):
  params:
    embedding: [vocab, d]
    lm_head: [vocab, d]

  forward:
    in: token_ids: [B, T, int32]
    out: logits: [B, T, vocab]

    graph:
      (token_ids, embedding) -> embedding() -> x
      x -> {double} -> h
      (h, lm_head) -> matmul(transpose=NT) -> logits
"""


def test_a_parameterless_module_called_inline_runs_like_its_graph(tmp_path):
    """`x -> Double() -> h` was exit 101 ("pass `lower` produced invalid Graph IR": the
    callee was never lowered); it must compute what the same graph written out does."""
    inputs = _inputs(tmp_path, token_ids=_ids(), d_logits=torch.randn(2, 5, 64,
                                                                      dtype=torch.float64))
    written = {}
    for name, double in (("inline", "Double()"), ("written", "(x, x) -> add()")):
        source = tmp_path / f"{name}.module"
        source.write_text(INLINE.replace("{double}", double).replace(
            "x -> (x, x) -> add()", "(x, x) -> add()"))
        out = tmp_path / f"{name}.safetensors"
        result = run("run", source, "--random-weights", "0", "--inputs", inputs,
                     "--outputs", out, "--backward")
        assert result.exit_code == 0, result.output
        written[name] = safetensors_torch.load_file(str(out))
    assert set(written["inline"]) == set(written["written"]) >= {"logits", "grad.embedding"}
    for key, value in written["written"].items():
        torch.testing.assert_close(written["inline"][key], value, rtol=0, atol=0)
