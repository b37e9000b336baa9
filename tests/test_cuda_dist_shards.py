"""Per-rank shard checkpoints on two GPUs (NCCL; `-m cuda`, skipped with fewer than two):
`torchrun --nproc-per-node 2 -m modulec train --device cuda --zero S --save` writes each
rank's shard (the split bf16/int16 masters and fp32 moments it holds); a resume on the same
layout loads them and continues as the uninterrupted run, and writes the same shards."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
np = pytest.importorskip("numpy")

from tests.dist_testing import free_port, needs_gpus  # noqa: E402

pytestmark = needs_gpus(2)

LLAMA = "std/models/llama.module"


@pytest.fixture(scope="module")
def gpu_ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpu_shards")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=256, num_hidden_layers=3, num_attention_heads=8,
        num_key_value_heads=2, intermediate_size=512, max_position_embeddings=128,
        rms_norm_eps=1e-5)
    transformers.LlamaForCausalLM(config).save_pretrained(folder / "hf")
    np.random.default_rng(0).integers(0, 512, 20000).astype("<u2").tofile(folder / "tokens.bin")
    return folder


def torchrun(ckpt, *args):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-port", str(free_port()), "-m", "modulec", "train", LLAMA,
               "--data", str(ckpt / "tokens.bin"), "--seq", "128", "--batch", "2",
               "--device", "cuda", "--lr", "1e-3", "--format", "json", *map(str, args)]
    env = dict(os.environ, NCCL_NVLS_ENABLE="0")
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr  # whole: the failing rank's error is not last
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("zero", [1, 3])
def test_gpu_resume_from_shards_continues_the_run(zero, gpu_ckpt, tmp_path):
    from safetensors.torch import load_file

    from runtime.cuda.state import joined_master

    whole = torchrun(gpu_ckpt, "--hf-weights", gpu_ckpt / "hf", "--steps", "6", "--zero",
                     zero, "--save", tmp_path / "a", "--save-every", "3")
    resumed = torchrun(gpu_ckpt, "--steps", "6", "--zero", zero, "--resume",
                       tmp_path / "a" / "checkpoint-3", "--save", tmp_path / "b")
    notes = [r["text"] for r in resumed if r["event"] == "note"]
    assert f"resumed at step 3 from the per-rank shards (2 ranks, ZeRO {zero})" in notes
    want = [r["loss"] for r in whole if r["event"] == "step"][3:]
    got = [r["loss"] for r in resumed if r["event"] == "step"]
    assert got == pytest.approx(want, rel=1e-3)
    for rank in (0, 1):
        name = f"shard-rank{rank:05d}.safetensors"
        a, b = (load_file(str(tmp_path / d / "checkpoint-6" / name)) for d in ("a", "b"))
        assert a.keys() == b.keys() and any(k.endswith(".lo") for k in a)
        for values in (a, b):  # the fp32 master from its halves
            for key in [k for k in values if k.endswith(".lo")]:
                values[key[:-3] + ".master"] = joined_master(values.pop(key[:-3] + ".hi"),
                                                             values.pop(key))
        for key in a:
            if not key.startswith("rng."):
                torch.testing.assert_close(b[key], a[key], rtol=1e-3, atol=1e-6, msg=key)


@pytest.mark.parametrize("layout", [("--zero", "3"), ("--tp", "2")])
def test_gpu_save_streams_the_whole_state_writes_bytes(layout, gpu_ckpt, tmp_path):
    """Rank 0 writes the weights tensor by tensor (runtime/train/consolidated.py): under
    ZeRO-3 the buckets gathered over NCCL one at a time, under --tp each parameter's
    slices; HF's sharded form (a small --max-shard-size) holds, file by file, the bytes
    safetensors' save_file writes from the whole fp32 masters (the ZeRO shards' halves
    joined, or the streamed optimizer file), and transformers loads it."""
    from safetensors.torch import load_file, save

    from runtime.hf_weights import export_hf_tensors
    from runtime.model import Model
    from runtime.train.checkpoint import read_optimizer

    torchrun(gpu_ckpt, "--hf-weights", gpu_ckpt / "hf", "--steps", "2", *layout,
             "--save", tmp_path / "a", "--max-shard-size", "1MB")
    folder = tmp_path / "a" / "checkpoint-2"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    model = Model.from_module(LLAMA, hf_weights=gpu_ckpt / "hf", dtype=torch.float32,
                              device="cpu")
    schema = model.source.program(planned=False).weight_schema
    weights = export_hf_tensors(schema, read_optimizer(folder)["masters"],
                                layout=model.hf_layout)
    files: dict = {}
    for name, file in index["weight_map"].items():
        files.setdefault(file, []).append(name)
    assert len(files) > 1
    ours = {k: v for f in files for k, v in load_file(str(folder / f)).items()}
    for file, names in files.items():  # cast to the saved dtype (--save-dtype auto)
        want = save({n: weights[n].to(ours[n].dtype).contiguous().clone() for n in names},
                    metadata={"format": "pt"})
        assert (folder / file).read_bytes() == want, file
    hf = transformers.LlamaForCausalLM.from_pretrained(folder)
    assert all(torch.equal(hf.state_dict()[k].to(ours[k].dtype), ours[k]) for k in ours)
