"""LoRA under pipeline parallel on two GPUs (NCCL; `-m cuda`, skipped with fewer than two):
`torchrun --nproc-per-node 2 -m modulec train --pp 2 --lora ... --device cuda` runs each
stage eagerly (the GPU step's kernels on bf16 copies; the adapters' fp32 masters stepped,
the base's fp32 values kept on the host: runtime/train/pipeline_precision.py), training its
own layers' adapters, the base frozen. It trains as one CPU process with --grad-accum M
over the same rows (within bf16 rounding), `--save` writes one PEFT adapter file of both
stages' adapters (gathered on rank 0) whose last step moved them as the CPU run's did,
beside the untouched base, and the checkpoint resumes on the two GPUs (--pp 2) and on one
CPU process as the CPU run continues. The exact (float64) equalities are the CPU test's: tests/test_pipeline_run.py
(`test_pp_lora_*`)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.bf16_parity import cosine  # noqa: E402
from tests.dist_testing import needs_gpus, train_records  # noqa: E402
from tests.test_cuda_dist_shards import LLAMA, gpu_ckpt  # noqa: E402,F401

pytestmark = needs_gpus(2)

LORA = "rank=8,alpha=16,targets=[q,v,down]"
ARGS = ("--seq", "64", "--batch", "1", "--lr", "1e-3", "--format", "json", "--steps", "3",
        "--lora", LORA)
BF16 = 1e-2  # relative: a bf16 step's loss against float32's over three steps


def _run(processes: int, *args) -> list[dict]:
    return train_records(processes, LLAMA, *args)


def _losses(rows: list[dict]) -> list[float]:
    return [r["loss"] for r in rows if r["event"] == "step"]


def test_two_gpu_stages_train_lora_as_one_process_and_resume(gpu_ckpt, tmp_path):
    from safetensors.torch import load_file

    from runtime.lora import WEIGHTS

    data = ("--data", str(gpu_ckpt / "tokens.bin"))
    weights = ("--hf-weights", str(gpu_ckpt / "hf"))
    pipeline = _run(2, *data, *weights, *ARGS, "--device", "cuda", "--pp", "2",
                    "--microbatches", "4", "--save", str(tmp_path / "pp"), "--save-every", "2")
    one = _run(1, *data, *weights, *ARGS, "--device", "cpu", "--grad-accum", "4", "--save",
               str(tmp_path / "one"), "--save-every", "2")
    assert next(r for r in pipeline if r["event"] == "done")["memory"] == "GPU"
    want = _losses(one)
    assert len(want) == 3 and _losses(pipeline) == pytest.approx(want, rel=BF16)
    pp, ref = tmp_path / "pp" / "checkpoint-3", tmp_path / "one" / "checkpoint-3"
    a, b = load_file(str(pp / WEIGHTS)), load_file(str(ref / WEIGHTS))
    a2 = load_file(str(tmp_path / "pp" / "checkpoint-2" / WEIGHTS))
    b2 = load_file(str(tmp_path / "one" / "checkpoint-2" / WEIGHTS))
    assert a.keys() == b.keys() and len(a) == 3 * 3 * 2  # 3 layers, q v down, A and B
    # the last step moved each adapter as the CPU run's moved (not to a tolerance per
    # element: Adam's first steps are about lr x sign(g), and bf16 flips small g's signs)
    for name in b:
        assert cosine(a[name] - a2[name], b[name] - b2[name]) > 0.9, name
    base, frozen = load_file(str(pp / "model.safetensors")), \
        load_file(str(ref / "model.safetensors"))
    assert base.keys() == frozen.keys() and all(torch.equal(base[k], frozen[k]) for k in base)
    resumed = _run(2, *data, *ARGS, "--device", "cuda", "--pp", "2", "--microbatches", "4",
                   "--resume", str(tmp_path / "pp" / "checkpoint-2"))
    assert _losses(resumed) == pytest.approx(want[2:], rel=BF16)
    on_cpu = _run(1, *data, *ARGS, "--device", "cpu", "--grad-accum", "4", "--resume",
                  str(tmp_path / "pp" / "checkpoint-2"))
    assert _losses(on_cpu) == pytest.approx(want[2:], rel=BF16)
