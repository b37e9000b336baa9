"""An IR document built with `--tp` trains (issue 17: the IR is the contract): `modulec
build MODEL --tp 2 -o model.ir`, then `torchrun --nproc-per-node 2 -m modulec train
model.ir` runs the same rank program a `--tp 2` run of the module builds, the size read
from the document's `tensor_parallel` section (docs/distributed.md, "Tensor parallel")."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.test_train import LLAMA, _tensors, ckpt, train  # noqa: E402,F401
from tests.test_train_dist import torchrun  # noqa: E402


def _build(ckpt, out, *extra):
    from tests.test_cli import run

    built = run("build", LLAMA, "--config", ckpt / "hf" / "config.json", "--shape", "B=2",
                "--shape", "T=16", "--tp", "2", "-o", out, *extra)
    assert built.exit_code == 0, built.output
    return out


def test_a_tp_ir_trains_as_the_module_with_tp(ckpt, tmp_path):
    """One step with --clip-grad from the saved TP 2 IR (no --tp given: the document's)
    equals one from the module with --tp 2, bit for bit: the loss and every saved weight
    and moment (float32, the slices joined into whole tensors)."""
    document = _build(ckpt, tmp_path / "tp2.ir")
    args = ("--steps", "1", "--batch", "2", "--clip-grad", "0.1")
    module = torchrun(ckpt, *args, "--tp", "2", "--save", tmp_path / "module")
    ir = torchrun(ckpt, *args, "--save", tmp_path / "ir", file=document)
    assert ir == module
    a, b = (_tensors(tmp_path / run / "checkpoint-1") for run in ("module", "ir"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_tp_ir_names_its_size_against_the_launch(ckpt, tmp_path):
    """The document says its size: a --tp that says otherwise, or a launch that is not a
    multiple of it (here one process), is an error naming both numbers."""
    document = _build(ckpt, tmp_path / "tp2.ir")
    base = ("train", document, "--data", ckpt / "tokens.bin", "--seq", "16", "--batch", "2",
            "--device", "cpu", "--hf-weights", ckpt / "hf", "--steps", "1")
    from tests.test_cli import run

    other = run(*base, "--tp", "4")
    assert other.exit_code == 1 and "Traceback" not in other.output
    assert f"{document} was built with --tp 2; this run asks for --tp 4" in other.output
    alone = run(*base)
    assert alone.exit_code == 1 and "Traceback" not in alone.output
    assert (f"{document} is a tensor-parallel rank program of size 2 (its tensor_parallel "
            "section); this launch has 1 process") in alone.output

