"""Memory checked before allocation (issue 16): `modulec run` and Model.from_module /
from_ir refuse a model whose parameters plus largest activation (a lower bound) exceed
what the device has, or --max-memory, naming the buffer or the parts, before any weight
is made."""

from __future__ import annotations

import gc

import pytest

torch = pytest.importorskip("torch")

from runtime import memory_check  # noqa: E402
from runtime.errors import RuntimeUserError  # noqa: E402
from runtime.model import Model  # noqa: E402
from tests.runtime_models import DENSE  # noqa: E402
from tests.dist_testing import needs_gpus  # noqa: E402
from tests.test_cli import run  # noqa: E402

LLAMA = "std/models/llama.module"
SETTINGS = [a for k, v in DENSE.items() for a in ("--set", f"{k}={v}")]


@pytest.fixture
def no_weights(monkeypatch):
    made = []
    monkeypatch.setattr(Model, "init_random", lambda self, *a, **k: made.append("init"))
    monkeypatch.setattr(Model, "load_hf", lambda self, *a, **k: made.append("load"))
    return made


def _run(tmp_path, *args):
    from safetensors.torch import save_file

    save_file({"token_ids": torch.zeros(2, 4, dtype=torch.int32)}, str(tmp_path / "in.st"))
    return run("run", *args, "--random-weights", "0", "--inputs", tmp_path / "in.st",
               "--outputs", tmp_path / "out.st")


def test_a_buffer_larger_than_max_memory_is_named(tmp_path, no_weights):
    result = _run(tmp_path, LLAMA, *SETTINGS, "--max-memory", "10KiB")
    assert result.exit_code == 1, result.output
    assert ("error: `embedding` [64, 32] float64 needs 16,384 bytes, more than the 10,240 "
            "bytes --max-memory allows") in result.output
    assert no_weights == [] and not (tmp_path / "out.st").exists()


def test_the_total_is_parameters_plus_the_largest_activation(tmp_path, no_weights):
    import re

    model = Model.from_module(LLAMA, settings=DENSE)
    parameters = sum(8 * torch.Size(s).numel() for s in model.parameter_shapes().values())
    result = _run(tmp_path, LLAMA, *SETTINGS, "--max-memory", "40KiB")
    assert result.exit_code == 1, result.output  # unsized activations: no activation counted
    assert (f"the model needs at least {parameters:,} bytes (parameters {parameters:,} bytes), "
            "more than the 40,960 bytes --max-memory allows") in result.output
    ir = tmp_path / "m.ir"  # sized: the largest activation counts too
    run("build", LLAMA, *SETTINGS, "--shape", "B=2", "--shape", "T=4", "-o", ir)
    result = _run(tmp_path, ir, "--max-memory", "155KiB")
    found = re.search(r"needs at least ([\d,]+) bytes \(parameters ([\d,]+) bytes, the largest "
                      r"activation `\w+` of `[\w#]+` ([\d,]+) bytes\)", result.output)
    assert found, result.output
    total, counted, largest = (int(g.replace(",", "")) for g in found.groups())
    assert counted == parameters and total == parameters + largest and largest >= 2 * 4 * 64 * 8
    assert no_weights == []


def test_the_machine_s_memory_is_the_default_limit(tmp_path, monkeypatch, no_weights):
    monkeypatch.setattr(memory_check, "_host_available", lambda: 8 * 2**30)
    result = _run(tmp_path, LLAMA, *SETTINGS, "--set", f"vocab_size={2**34}")
    assert result.exit_code == 1, result.output
    assert ("`embedding` [17179869184, 32] float64 needs 4096.00 GiB, more than the 8.00 GiB "
            "this machine has available") in result.output
    assert no_weights == []


def test_an_ir_document_is_checked_before_its_weights(tmp_path, no_weights):
    ir = tmp_path / "m.ir"
    assert run("build", LLAMA, *SETTINGS, "--shape", "B=2", "--shape", "T=4", "-o", ir
               ).exit_code == 0
    result = _run(tmp_path, ir, "--max-memory", "10KiB")
    assert result.exit_code == 1 and "`embedding` [64, 32]" in result.output, result.output
    assert no_weights == []


def test_a_model_that_fits_runs(tmp_path):
    result = _run(tmp_path, LLAMA, *SETTINGS, "--max-memory", "1GiB")
    assert result.exit_code == 0, result.output


def test_max_memory_must_be_a_size(tmp_path):
    result = _run(tmp_path, LLAMA, *SETTINGS, "--max-memory", "lots")
    assert result.exit_code == 2 and "not a size" in result.output


def test_the_host_reports_some_memory():
    available, where = memory_check.available_bytes("cpu")
    assert available > 0 and where == "this machine has available"


@needs_gpus(1)
def test_a_model_larger_than_the_gpu_is_refused_before_allocating():
    gc.collect()  # earlier tests' garbage would be freed inside the measured span
    before = torch.cuda.memory_allocated()
    with pytest.raises(RuntimeUserError, match=r"`embedding` \[17179869184, 32\] bfloat16 "
                       r"needs 1024.00 GiB, more than the .* GiB GPU 0 has free"):
        Model.from_module(LLAMA, settings=DENSE | {"vocab_size": 2**34}, device="cuda",
                          dtype=torch.bfloat16)
    gc.collect()
    assert torch.cuda.memory_allocated() <= before  # nothing of the refused model stayed


def test_train_refuses_before_loading(tmp_path, no_weights):
    import numpy as np

    tokens = tmp_path / "tokens.bin"
    np.arange(200, dtype="<u2").__mod__(64).tofile(tokens)
    result = run("train", LLAMA, *SETTINGS, "--data", tokens, "--seq", "8", "--batch", "1",
                 "--steps", "1", "--device", "cpu", "--init", "random", "--max-memory", "10KiB")
    assert result.exit_code == 1, result.output
    assert ("`blocks[0].mlp.up_weight` [96, 32] float32 needs 12,288 bytes, more than the "
            "10,240 bytes --max-memory allows") in result.output
    assert no_weights == []


def test_a_gpu_step_whose_state_does_not_fit_is_refused_before_it_allocates(monkeypatch):
    """The CUDA trainer checks the step's fixed state (runtime_fixed_bytes) against the
    free device memory first: it was an out-of-memory error mid-allocation (exit 101)."""
    monkeypatch.setattr(memory_check, "available_bytes",
                        lambda device: (3 * 2**30, "GPU 0 has free"))
    with pytest.raises(RuntimeUserError) as raised:
        memory_check.check_step_state(12 * 2**30, "cuda")
    message = str(raised.value.message)
    assert "needs at least 12.00 GiB for its weights, masters and optimizer state" in message
    assert "more than the 3.00 GiB GPU 0 has free" in message
    assert any("--zero 3" in h for h in raised.value.help)
    memory_check.check_step_state(2 * 2**30, "cuda")  # fits: no error
    with pytest.raises(RuntimeUserError, match="--max-memory allows"):
        memory_check.check_step_state(2 * 2**30, "cuda", max_memory=2**30)
