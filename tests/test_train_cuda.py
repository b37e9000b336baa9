"""`modulec train --device cuda` on a GPU (`-m cuda`; skipped without CUDA): a small Llama
from an HF checkpoint lowers the loss on a repeated batch through the CUDA graph, resumes
where it stopped, and its checkpoint gives transformers (bf16) our loss."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")
transformers = pytest.importorskip("transformers")

from tests.test_cli import run  # noqa: E402
from tests.dist_testing import needs_gpus  # noqa: E402

pytestmark = needs_gpus(1)

LLAMA = "std/models/llama.module"
VOCAB, B, T = 512, 2, 128


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("train_cuda")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, intermediate_size=512, max_position_embeddings=T,
        rms_norm_eps=1e-5)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder / "hf")
    np.random.default_rng(0).integers(0, VOCAB, 20000).astype("<u2").tofile(
        folder / "tokens.bin")
    return folder


def train(ckpt, *args):
    result = run("train", LLAMA, "--data", ckpt / "tokens.bin", "--seq", T, "--batch", B,
                 "--lr", "1e-3", "--format", "json", "--repeat-batch", *args)
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    return [r["loss"] for r in rows if r["event"] == "step"]


def test_train_resume_and_load_in_transformers(ckpt, tmp_path):
    whole = train(ckpt, "--hf-weights", ckpt / "hf", "--steps", "8")
    assert whole[-1] < 0.8 * whole[0]
    first = train(ckpt, "--hf-weights", ckpt / "hf", "--steps", "5", "--save", tmp_path / "s")
    rest = train(ckpt, "--steps", "8", "--resume", tmp_path / "s")
    assert first == pytest.approx(whole[:5], rel=5e-3)  # FlashAttention's backward is
    assert rest == pytest.approx(whole[5:], rel=5e-3)   # not deterministic: bf16 noise
    folder = tmp_path / "s" / "checkpoint-5"
    hf = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda()
    from runtime.train.data import TokenData

    window = TokenData(ckpt / "tokens.bin", "uint16", T, B).batch_at(0).cuda()
    with torch.no_grad():
        logits = hf(input_ids=window[:, :-1]).logits.float()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), window[:, 1:].reshape(-1))
    assert float(loss) == pytest.approx(rest[0], rel=1e-2)  # step 6 starts from checkpoint-5


def test_lora_trains_on_the_gpu_saves_adapters_and_resumes(ckpt, tmp_path):
    from safetensors.torch import load_file

    args = ("--lora", "rank=4,alpha=8")
    whole = train(ckpt, "--hf-weights", ckpt / "hf", "--steps", "8", *args)
    assert whole[-1] < whole[0]
    first = train(ckpt, "--hf-weights", ckpt / "hf", "--steps", "5", *args,
                  "--save", tmp_path / "s")
    rest = train(ckpt, "--steps", "8", *args, "--resume", tmp_path / "s")
    assert first == pytest.approx(whole[:5], rel=5e-3)
    assert rest == pytest.approx(whole[5:], rel=5e-3)
    folder = tmp_path / "s" / "checkpoint-5"
    base = load_file(str(folder / "model.safetensors"))
    start = load_file(str(ckpt / "hf" / "model.safetensors"))
    assert base.keys() == start.keys()
    assert all(torch.equal(base[k], start[k].to(base[k].dtype)) for k in base)  # frozen
    adapters = load_file(str(folder / "adapter_model.safetensors"))
    assert any(k.endswith("q_proj.lora_A.weight") for k in adapters)
    assert any(v.abs().max() > 0 for k, v in adapters.items() if "lora_B" in k)


def test_lora_under_a_memory_budget_trains_as_without_one(ckpt):
    """`--lora` with `--memory-budget` on the GPU: the plan recomputes activations (the run
    says how many) and the losses are the unbudgeted run's, within bf16 noise."""
    from tests.test_cuda_train import _budget_between

    targets = ["q", "k", "v", "o", "gate", "up", "down"]
    args = ("--lora", f"rank=4,alpha=8,targets=[{','.join(targets)}]",
            "--hf-weights", ckpt / "hf", "--steps", "6")
    plain = train(ckpt, *args)
    budget = _budget_between(False, 0.2, lora=dict(rank=4, alpha=8, targets=targets))
    result = run("train", LLAMA, "--data", ckpt / "tokens.bin", "--seq", T, "--batch", B,
                 "--lr", "1e-3", "--format", "json", "--repeat-batch", *args,
                 "--memory-budget", str(budget))
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    notes = [r["text"] for r in rows if r["event"] == "note" and "--memory-budget" in r["text"]]
    assert len(notes) == 1 and "recomputes 0 " not in notes[0], notes
    budgeted = [r["loss"] for r in rows if r["event"] == "step"]
    assert budgeted == pytest.approx(plain, rel=5e-3)
    assert budgeted[-1] < budgeted[0]


def test_gpt2_trains_on_the_gpu_with_its_head_tied(ckpt, tmp_path):
    """std/models/gpt2.module: position ids fed, the LM head tied to wte (one master, the two
    gradients summed); the checkpoint loads in transformers with the loss we reached."""
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=256, n_layer=2, n_head=8,
                                     n_positions=T)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "hf")
    result = run("train", "std/models/gpt2.module", "--data", ckpt / "tokens.bin", "--seq", T,
                 "--batch", B, "--lr", "1e-3", "--format", "json", "--repeat-batch",
                 "--hf-weights", tmp_path / "hf", "--steps", "8", "--save", tmp_path / "run")
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    losses = [r["loss"] for r in rows if r["event"] == "step"]
    assert losses[-1] < 0.8 * losses[0]
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "run" / "checkpoint-8"))
    from runtime.train.data import TokenData

    window = TokenData(ckpt / "tokens.bin", "uint16", T, B).batch_at(0)
    with torch.no_grad():
        loss = hf(input_ids=window[:, :-1].long(), labels=window[:, :-1].long()).loss
    assert float(loss) < 0.9 * losses[0]  # trained: below the first step's loss
