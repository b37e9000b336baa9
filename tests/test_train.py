"""`modulec train` on the CPU (`--device cpu`, float32 reference): the loss falls on a
repeated batch, N steps + resume + M steps equals N + M steps, the saved checkpoint loads
in transformers with our logits, a failed save leaves no checkpoint, and each user mistake
is one clear error (exit 1, no traceback)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")
transformers = pytest.importorskip("transformers")

from tests.test_cli import run  # noqa: E402

LLAMA = "std/models/llama.module"
VOCAB = 64


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny HF Llama checkpoint (vocab 64, d 32, 2 layers, 4/2 heads) and 5000 tokens."""
    folder = tmp_path_factory.mktemp("train")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=48, max_position_embeddings=64,
        rms_norm_eps=1e-5)
    transformers.LlamaForCausalLM(config).save_pretrained(folder / "hf")
    tokens = np.random.default_rng(0).integers(0, VOCAB, 5000).astype("<u2")
    tokens.tofile(folder / "tokens.bin")
    return folder


def train(ckpt, *args, weights=True):
    base = ["train", LLAMA, "--data", ckpt / "tokens.bin", "--seq", "16", "--batch", "2",
            "--device", "cpu", "--lr", "1e-2", "--format", "json"]
    return run(*base, *(["--hf-weights", ckpt / "hf"] if weights else []), *args)


def events(result, kind="step") -> list[dict]:
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    return [r for r in rows if r["event"] == kind]


def losses(result) -> list[float]:
    return [r["loss"] for r in events(result)]


def test_loss_falls_on_a_repeated_batch(ckpt):
    got = losses(train(ckpt, "--steps", "20", "--repeat-batch"))
    assert len(got) == 20
    assert got[-1] < 0.5 * got[0] and got[9] < got[0]


def test_resume_continues_exactly_as_one_run(ckpt, tmp_path):
    whole = train(ckpt, "--steps", "8", "--save", tmp_path / "a")
    first = train(ckpt, "--steps", "5", "--save", tmp_path / "b")
    rest = train(ckpt, "--steps", "8", "--resume", tmp_path / "b", "--save", tmp_path / "b",
                 weights=False)
    assert losses(first) + losses(rest) == losses(whole)  # float32 on the CPU: bit for bit
    assert [r["step"] for r in events(rest)] == [6, 7, 8]
    a = _tensors(tmp_path / "a" / "checkpoint-8")
    b = _tensors(tmp_path / "b" / "checkpoint-8")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    state = json.loads((tmp_path / "b" / "checkpoint-8" / "trainer_state.json").read_text())
    assert state["step"] == 8 and state["samples"] == 16 and len(state["losses"]) == 8
    assert (tmp_path / "b" / "latest").read_text().strip() == "checkpoint-8"


def test_gradient_accumulation_equals_the_whole_batch(ckpt, tmp_path):
    """--batch 1 --grad-accum 2 reads the same windows as --batch 2 and averages the two
    micro-batches' gradients: the same losses and weights up to float32 rounding."""
    whole = train(ckpt, "--steps", "3", "--save", tmp_path / "whole")
    micro = run("train", LLAMA, "--data", ckpt / "tokens.bin", "--seq", "16", "--batch", "1",
                "--grad-accum", "2", "--device", "cpu", "--lr", "1e-2", "--format", "json",
                "--hf-weights", ckpt / "hf", "--steps", "3", "--save", tmp_path / "micro")
    assert losses(micro) == pytest.approx(losses(whole), rel=1e-5)
    a = _tensors(tmp_path / "whole" / "checkpoint-3")
    b = _tensors(tmp_path / "micro" / "checkpoint-3")
    assert a.keys() == b.keys()
    assert all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6) for k in a)
    state = json.loads((tmp_path / "micro" / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["samples"] == 6 and state["grad_accum"] == 2


def _tensors(folder) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors")) | {
        f"opt.{k}": v for k, v in load_file(str(folder / "optimizer.safetensors")).items()}


def test_saved_checkpoint_loads_in_transformers_with_our_logits(ckpt, tmp_path):
    from runtime.model import Model

    events(train(ckpt, "--steps", "6", "--save", tmp_path / "s"))
    folder = tmp_path / "s" / "checkpoint-6"
    hf = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ours = Model.from_module(LLAMA, hf_weights=folder, dtype=torch.float32)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    theirs = hf(input_ids=ids.long()).logits
    mine = ours.forward(token_ids=ids.to(torch.int32))["logits"]
    assert torch.allclose(mine, theirs, atol=1e-4, rtol=1e-4)
    start = transformers.LlamaForCausalLM.from_pretrained(ckpt / "hf", dtype=torch.float32)
    assert not torch.allclose(start(input_ids=ids.long()).logits, theirs)  # it trained


def test_a_failed_save_leaves_no_checkpoint(ckpt, tmp_path, monkeypatch):
    from runtime.hf_weights.stream import StreamFile

    events(train(ckpt, "--steps", "2", "--save", tmp_path / "s"))
    before = _tensors(tmp_path / "s" / "checkpoint-2")

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(StreamFile, "write", disk_full)  # mid-file, tensor by tensor
    result = train(ckpt, "--steps", "4", "--resume", tmp_path / "s", "--save", tmp_path / "s",
                   weights=False)
    assert result.exit_code == 1 and "No space left on device" in result.output
    assert "Traceback" not in result.output
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["checkpoint-2", "latest"]
    assert (tmp_path / "s" / "latest").read_text().strip() == "checkpoint-2"
    after = _tensors(tmp_path / "s" / "checkpoint-2")
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_an_unfinished_checkpoint_is_not_resumed(ckpt, tmp_path):
    events(train(ckpt, "--steps", "2", "--save", tmp_path / "s"))
    (tmp_path / "s" / "checkpoint-2" / "trainer_state.json").unlink()  # as if never written
    (tmp_path / "s" / "latest").unlink()
    result = train(ckpt, "--steps", "4", "--resume", tmp_path / "s", weights=False)
    assert result.exit_code == 1 and "holds no complete checkpoint" in result.output



def _kill_between_the_renames(monkeypatch):
    """os.replace raises where a re-save has moved the old folder aside and not yet
    renamed the new one into place: the state a kill -9 there leaves (issue 16 item 9)."""
    import os

    real = os.replace

    def replace(src, dst, *args, **kwargs):
        if Path(src).name.endswith(".tmp") and Path(dst).name.startswith("checkpoint-"):
            raise OSError("killed")
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)


def test_a_resave_killed_between_its_renames_still_resumes(ckpt, tmp_path, monkeypatch):
    events(train(ckpt, "--steps", "2", "--save", tmp_path / "s"))
    before = _tensors(tmp_path / "s" / "checkpoint-2")
    with monkeypatch.context() as patch:
        _kill_between_the_renames(patch)
        assert train(ckpt, "--steps", "2", "--save", tmp_path / "s").exit_code == 1
    assert not (tmp_path / "s" / "checkpoint-2").exists()  # the gap the kill left
    assert (tmp_path / "s" / "latest").read_text().strip() == "checkpoint-2"
    rest = train(ckpt, "--steps", "4", "--resume", tmp_path / "s", "--save", tmp_path / "s",
                 weights=False)
    assert [r["step"] for r in events(rest)] == [3, 4]
    # the next save put the old step back rather than leaving it hidden
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == \
        ["checkpoint-2", "checkpoint-4", "latest"]
    after = _tensors(tmp_path / "s" / "checkpoint-2")
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_temporary_folders_of_killed_saves_are_removed(ckpt, tmp_path):
    save = tmp_path / "s"
    save.mkdir()
    for name in (".checkpoint-2.abc123.tmp", ".checkpoint-7.x.tmp"):
        (save / name).mkdir()
        (save / name / "model.safetensors").write_bytes(b"x" * 100)
    keep = [".checkpoint-2.notes.tmp.txt", "mine.tmp", ".checkpoint-9.tmp"]
    (save / keep[0]).write_text("a file, not a folder")
    (save / keep[1]).mkdir()
    (save / keep[2]).symlink_to(tmp_path, target_is_directory=True)  # never followed
    events(train(ckpt, "--steps", "2", "--save", save))
    assert sorted(p.name for p in save.iterdir()) == sorted(keep + ["checkpoint-2", "latest"])
    assert tmp_path.exists()


def test_save_every_and_human_lines(ckpt, tmp_path):
    result = run("train", LLAMA, "--hf-weights", ckpt / "hf", "--data", ckpt / "tokens.bin",
                 "--seq", "8", "--batch", "1", "--steps", "4", "--device", "cpu",
                 "--save", tmp_path / "s", "--save-every", "2")
    assert result.exit_code == 0, result.output
    assert "step 3/4  loss" in result.stderr and "tokens/s" in result.stderr
    assert "trained steps 1..4" in result.stdout
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == \
        ["checkpoint-2", "checkpoint-4", "latest"]


def test_batches_are_windows_in_a_seeded_order(ckpt):
    from runtime.train.data import TokenData

    tokens = np.fromfile(ckpt / "tokens.bin", dtype="<u2")
    data = TokenData(ckpt / "tokens.bin", "uint16", seq=16, batch=4, seed=3)
    starts = []
    for step in range(data.windows // 4 + 1):  # past one epoch
        for row in data.batch_at(step):
            start = int(np.flatnonzero((np.lib.stride_tricks.sliding_window_view(
                tokens, 17) == row.numpy()).all(1))[0])
            assert start % 16 == 0
            starts.append(start)
    epoch = starts[:data.windows]
    assert sorted(epoch) == list(range(0, data.windows * 16, 16))
    assert epoch != sorted(epoch)
    again = TokenData(ckpt / "tokens.bin", "uint16", seq=16, batch=4, seed=3)
    assert torch.equal(again.batch_at(5), data.batch_at(5))
    other = TokenData(ckpt / "tokens.bin", "uint16", seq=16, batch=4, seed=4)
    assert not torch.equal(other.batch_at(0), data.batch_at(0))


def test_adamw_matches_torch():
    from runtime.train.optim import AdamW

    g = torch.Generator().manual_seed(0)
    start = torch.randn(5, 7, generator=g)
    reference = start.clone().requires_grad_(False)
    torch_opt = torch.optim.AdamW([reference], lr=1e-2, betas=(0.9, 0.95), eps=1e-8,
                                  weight_decay=0.1, foreach=False)
    ours, params = AdamW(lr=1e-2, weight_decay=0.1), {"w": start.clone()}
    for _ in range(4):
        grad = torch.randn(5, 7, generator=g)
        reference.grad = grad.clone()
        torch_opt.step()
        ours.update(params, {"w": grad})
    assert torch.allclose(params["w"], reference, atol=1e-6, rtol=1e-6) and ours.step == 4


@pytest.mark.parametrize("args, message", [
    (["--data", "missing.bin"], "missing.bin does not exist"),
    (["--seq", "4096"], "longer than the model's max_seq (64)"),
    (["--batch", "400", "--seq", "16"], "too few for one batch of 400 x 16"),
    (["--dtype-tokens", "uint32"], "vocab_size is 64"),
    (["--memory-budget", "1KiB"], "budget"),
    (["--save-every", "2"], "--save-every needs --save DIR"),
    (["--grad-accum", "0"], "--grad-accum must be at least 1"),
    (["--batch", str(10**12)], "too few for one batch of 1000000000000 x 8"),
    (["--lr", "nan"], "--lr is nan: it must be a finite number >= 0"),
    (["--lr", "-1"], "--lr is -1.0: it must be a finite number >= 0"),
    (["--weight-decay", "inf"], "--weight-decay is inf"),
    (["--log-every", "0"], "--log-every must be at least 1, not 0"),
    (["--eval-data", "eval.bin", "--eval-every", "3", "--log-every", "2"],
     "--eval-every 3 is not a multiple of --log-every 2"),
])
def test_mistakes_are_one_clear_error(ckpt, tmp_path, args, message):
    base = {"--data": str(ckpt / "tokens.bin"), "--seq": "8", "--batch": "2"}
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = str(tmp_path / value) if value.endswith(".bin") else value
    result = run("train", LLAMA, "--hf-weights", ckpt / "hf", "--steps", "2", "--device",
                 "cpu", *[x for pair in base.items() for x in pair])
    assert result.exit_code == 1, result.output
    assert message in result.output and "Traceback" not in result.output


def test_a_bad_token_id_anywhere_is_refused_before_step_1(ckpt, tmp_path):
    # The id sits in the last window: found lazily only at the batch that drew it.
    tokens = np.fromfile(ckpt / "tokens.bin", dtype="<u2")
    tokens[4000] = 65535
    tokens.tofile(tmp_path / "bad.bin")
    result = run("train", LLAMA, "--hf-weights", ckpt / "hf", "--data", tmp_path / "bad.bin",
                 "--seq", "8", "--batch", "1", "--steps", "1", "--device", "cpu")
    assert result.exit_code == 1, result.output
    assert "token id 65535 (first bad id at token 4,000)" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("kind", ["device", "fifo"])
def test_data_that_is_not_a_regular_file(ckpt, tmp_path, kind):
    path = Path("/dev/zero") if kind == "device" else tmp_path / "fifo"
    if kind == "fifo":
        os.mkfifo(path)
    result = run("train", LLAMA, "--hf-weights", ckpt / "hf", "--data", path,
                 "--seq", "8", "--batch", "1", "--steps", "1", "--device", "cpu")
    assert result.exit_code == 1, result.output
    assert "is not a regular file" in result.output and "does not exist" not in result.output


def test_a_checkpoint_config_that_is_a_list(ckpt, tmp_path):
    import shutil

    shutil.copytree(ckpt / "hf", tmp_path / "hf")
    (tmp_path / "hf" / "config.json").write_text("[1, 2]")
    result = run("train", LLAMA, "--hf-weights", tmp_path / "hf", "--data",
                 ckpt / "tokens.bin", "--seq", "8", "--batch", "1", "--steps", "1",
                 "--device", "cpu")
    assert result.exit_code == 1, result.output
    assert "config.json is a JSON list, not an object" in result.output
    assert "Traceback" not in result.output


def test_odd_sized_data_file(ckpt, tmp_path):
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    result = run("train", LLAMA, "--hf-weights", ckpt / "hf", "--data", tmp_path / "odd.bin",
                 "--seq", "8", "--batch", "1", "--steps", "1", "--device", "cpu")
    assert result.exit_code == 1 and "not a whole number of uint16 tokens" in result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_cuda_without_a_gpu(ckpt):
    result = run("train", LLAMA, "--hf-weights", ckpt / "hf", "--data", ckpt / "tokens.bin",
                 "--seq", "8", "--batch", "1", "--steps", "1")
    assert result.exit_code == 1 and "no CUDA device is available" in result.output


def test_resume_refuses_other_settings_and_finished_runs(ckpt, tmp_path):
    events(train(ckpt, "--steps", "2", "--save", tmp_path / "s"))
    other = train(ckpt, "--steps", "4", "--batch", "1", "--resume", tmp_path / "s",
                  weights=False)
    assert other.exit_code == 1 and "--batch is 1" in other.output
    done = train(ckpt, "--steps", "2", "--resume", tmp_path / "s", weights=False)
    assert done.exit_code == 1 and "leaves nothing to run" in done.output
    none = train(ckpt, "--steps", "2", weights=False)
    assert none.exit_code == 1 and "--hf-weights DIR" in none.output


def test_cpu_memory_budget_executes_the_plan_with_the_same_losses(ckpt):
    """335 KiB is under this run's no-recompute peak (344 KiB): the planner recomputes
    and swaps, the CPU trainer executes it, and float32 losses do not move."""
    from runtime.decisions import Decisions
    from runtime.model import Model

    model = Model.from_module(LLAMA, hf_weights=ckpt / "hf", memory_budget=335 * 1024)
    program = model.source.program_for({"token_ids": torch.zeros(2, 8, dtype=torch.int32)})
    table = Decisions.from_schedule(program.document["schedule"]).table
    assert any(kind != "keep" for rows in table.values() for kind, *_ in rows)
    plain = losses(train(ckpt, "--steps", "3", "--seq", "8"))
    planned = losses(train(ckpt, "--steps", "3", "--seq", "8", "--memory-budget", "335KiB"))
    assert planned == pytest.approx(plain, rel=1e-6)


# ====================================================================== LoRA (CPU)
def test_lora_trains_only_the_adapters_and_saves_them(ckpt, tmp_path):
    result = train(ckpt, "--steps", "12", "--repeat-batch", "--lora", "rank=4,alpha=8",
                   "--save", tmp_path / "lora")
    got = losses(result)
    assert got[-1] < got[0]
    folder = tmp_path / "lora" / "checkpoint-12"
    base = _tensors_file(folder / "model.safetensors")
    start = _tensors_file(ckpt / "hf" / "model.safetensors")
    assert base.keys() == start.keys()  # the base checkpoint, no adapter tensors in it
    assert all(torch.equal(base[k], start[k].to(base[k].dtype)) for k in base)  # frozen
    adapters = _tensors_file(folder / "adapter_model.safetensors")
    assert any(k.endswith("q_proj.lora_A.weight") for k in adapters)
    assert any(k.endswith("down_proj.lora_B.weight") for k in adapters)
    assert any(v.abs().max() > 0 for k, v in adapters.items() if "lora_B" in k)  # trained
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8


def test_lora_resume_continues_exactly(ckpt, tmp_path):
    args = ("--lora", "rank=4,alpha=8")
    whole = train(ckpt, "--steps", "6", *args, "--save", tmp_path / "a")
    first = train(ckpt, "--steps", "4", *args, "--save", tmp_path / "b")
    rest = train(ckpt, "--steps", "6", *args, "--resume", tmp_path / "b", weights=False)
    assert losses(first) + losses(rest) == losses(whole)


def test_a_resume_trains_the_adapters_its_checkpoint_holds(ckpt, tmp_path):
    """--resume with another --lora rank (or targets, alpha) was an internal error (a
    rank-16 A copied into a rank-4 one: exit 101); without --lora it trained the whole
    model and dropped the checkpoint's adapters unsaid; --lora from a checkpoint without
    adapters is refused too (its weights start LoRA through --hf-weights)."""
    lora = train(ckpt, "--steps", "1", "--lora", "rank=4,alpha=8", "--save", tmp_path / "l")
    plain = train(ckpt, "--steps", "1", "--save", tmp_path / "p")
    assert lora.exit_code == 0 and plain.exit_code == 0
    cases = [(("--lora", "rank=2,alpha=8"), tmp_path / "l",
              "--lora gives rank 2, alpha 8.0, targets"),
             (("--lora", "rank=4,alpha=8,targets=[q]"), tmp_path / "l", "targets q_proj, but"),
             ((), tmp_path / "l", "holds LoRA adapters (rank 4, alpha 8.0, targets"),
             (("--lora", "rank=4,alpha=8"), tmp_path / "p", "was trained without LoRA")]
    for args, folder, message in cases:
        result = train(ckpt, "--steps", "2", *args, "--resume", folder, weights=False)
        assert result.exit_code == 1, (args, result.output)
        assert message in result.output and "Traceback" not in result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests/test_train_cuda.py runs it")
def test_lora_on_the_gpu_needs_a_cuda_device_only(ckpt):
    result = run("train", LLAMA, "--hf-weights", ckpt / "hf", "--data", ckpt / "tokens.bin",
                 "--seq", "16", "--batch", "2", "--steps", "1", "--lora", "--device", "cuda")
    assert result.exit_code == 1 and "no CUDA device is available" in result.output


def _tensors_file(path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


def test_gpt2_trains_with_position_ids_fed(ckpt, tmp_path):
    """std/models/gpt2.module takes position_ids: the trainer feeds 0 .. T-1 in each row."""
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                     n_positions=64)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "hf")
    result = run("train", "std/models/gpt2.module", "--hf-weights", tmp_path / "hf", "--data",
                 ckpt / "tokens.bin", "--seq", "16", "--batch", "2", "--device", "cpu",
                 "--lr", "1e-2", "--format", "json", "--steps", "12", "--repeat-batch",
                 "--save", tmp_path / "run")
    got = losses(result)
    assert len(got) == 12 and got[-1] < 0.7 * got[0]
    # the checkpoint holds wte (the head's tie target, which owns the trained value)
    saved = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "run" / "checkpoint-12"))
    assert not torch.equal(saved.transformer.wte.weight,
                           transformers.GPT2LMHeadModel.from_pretrained(
                               str(tmp_path / "hf")).transformer.wte.weight)


def test_training_feeds_tokens_and_positions_only():
    from runtime.inputs import fed_inputs, positions_like, unfed

    assert unfed(["token_ids"]) == [] and unfed(["token_ids", "position_ids"]) == []
    assert unfed(["token_ids", "mask"]) == ["mask"] and unfed(["x"]) == ["x", "token_ids"]
    tokens = torch.zeros(3, 5, dtype=torch.int32)
    assert torch.equal(positions_like(tokens), torch.arange(5, dtype=torch.int32).repeat(3, 1))
    assert fed_inputs(["token_ids"], tokens).keys() == {"token_ids"}


TINY_LM = """\
model TinyLM(vocab: int = 16, d: int = 8):
  params:
    embedding: [vocab, d] {embedding}
    norm: [d] {norm}
    proj: [d, d] {proj}
    lm_head: [vocab, d] {lm_head}
  forward:
    in: token_ids: [B, T, int32]
    out: logits: [B, T, vocab]
    graph:
      (token_ids, embedding) -> embedding() -> h
      (h, norm) -> mul() -> g
      g -> matmul(proj, transpose=NT) -> p
      p -> matmul(lm_head, transpose=NT) -> logits
"""
ANNOTATED = dict(embedding="@trainable(wd_scale=0.0)", norm="@frozen",
                 proj="@trainable(grad_clip=0.001)", lm_head="@trainable(lr_scale=0.5)")


def _one_cpu_step(tmp_path, notes: dict):
    from runtime.model import Model
    from runtime.train.backends import CPUTrainer
    from runtime.train.optim import AdamW

    path = tmp_path / f"tiny{len(notes)}.module"
    path.write_text(TINY_LM.format(**{k: notes.get(k, "") for k in ANNOTATED}))
    model = Model.from_module(path, dtype=torch.float32).init_random(0, std=0.5)
    start = {p: t.clone() for p, t in model.params.items()}
    # decay_all: the embedding's decay is the default, so its wd_scale=0 shows
    trainer = CPUTrainer(model, batch=2, seq=6,
                         adamw=AdamW(lr=1e-2, weight_decay=0.1, decay_all=True))
    window = torch.randint(0, 16, (2, 7), generator=torch.Generator().manual_seed(1))
    trainer.train_step(window)
    return start, model.params, trainer


def test_cpu_trainer_honours_trainable_and_frozen(tmp_path):
    start, plain, _ = _one_cpu_step(tmp_path, {})
    _, params, trainer = _one_cpu_step(tmp_path, ANNOTATED)
    step = {p: params[p] - start[p] for p in params}
    plain_step = {p: plain[p] - start[p] for p in plain}
    assert torch.allclose(step["lm_head"], 0.5 * plain_step["lm_head"], atol=1e-7)  # lr_scale
    decay = -1e-2 * 0.1 * start["embedding"]  # the weight decay wd_scale=0 leaves out
    assert torch.allclose(step["embedding"], plain_step["embedding"] - decay, atol=1e-7)
    assert torch.equal(params["norm"], start["norm"])  # @frozen: not updated,
    assert "norm" not in trainer.adamw.exp_avg  # and no optimizer state
    # grad_clip: the gradient AdamW saw has norm 0.001 (its first moment is 0.1 of it)
    assert float(trainer.adamw.exp_avg["proj"].norm()) == pytest.approx(1e-4, rel=1e-4)


def test_training_settings_are_in_the_program(tmp_path):
    from runtime.train.param_groups import frozen_parameters, hyperparameters
    from runtime.train.optim import AdamW

    *_, trainer = _one_cpu_step(tmp_path, ANNOTATED)
    program, base = trainer.program, AdamW(lr=1.0, weight_decay=0.1)
    assert frozen_parameters(program) == {"norm"}
    assert program.metadata["training"]["parameters"]["proj"] == {"grad_clip": 0.001}
    assert hyperparameters(program, "lm_head", base) == (0.5, 0.1, None)
    assert hyperparameters(program, "embedding", base) == (1.0, 0.0, None)
    assert hyperparameters(program, "proj", base) == (1.0, 0.1, 0.001)


# ---------------------------------------------------------------------- --log-every
def _mean(values) -> float:
    import math

    return values[0] if len(values) == 1 else math.fsum(values) / len(values)


def test_log_every_records_the_means_of_its_windows(ckpt, tmp_path):
    """--log-every 2 over 5 steps: records at steps 2, 4 and 5 (the last, a partial
    window), each the mean loss and gradient norm of its steps in the --log-every 1 run
    (same seed and data: bit-identical steps), in the progress and in metrics.jsonl;
    the summary's losses are the steps' own."""
    each = events(train(ckpt, "--steps", "5"))
    result = train(ckpt, "--steps", "5", "--log-every", "2", "--log-dir", tmp_path / "log")
    windows = events(result)
    assert [(r["step"], r["window"]) for r in windows] == [(2, 2), (4, 2), (5, 1)]
    assert all("window" not in r for r in each)  # K = 1: the records as without it
    for record, steps in zip(windows, [each[0:2], each[2:4], each[4:5]]):
        for field in ("loss", "grad_norm"):
            assert record[field] == pytest.approx(_mean([s[field] for s in steps]),
                                                  rel=1e-12, abs=0)
        assert record["lr"] == steps[-1]["lr"]
        assert record["tokens_per_s"] == pytest.approx(
            2 * 16 * len(steps) / (record["seconds"] * len(steps)), rel=1e-9)
    assert windows[2]["loss"] == each[4]["loss"]  # a window of one: the step's own
    logged = [json.loads(x) for x in (tmp_path / "log" / "metrics.jsonl").read_text()
              .splitlines()]
    assert [(r["step"], r["window"], r["loss"]) for r in logged] == \
        [(r["step"], r["window"], r["loss"]) for r in windows]
    done, = events(result, "done")
    assert (done["loss_first"], done["loss_last"]) == (each[0]["loss"], each[4]["loss"])


def test_log_every_windows_end_at_saves_and_resume_at_global_steps(ckpt, tmp_path):
    """A save ends a window (step 3 with --save-every 3), so the records up to a
    checkpoint cover its steps; the run resumed from it logs at the same global steps
    (4: the window 3..4 cut by the resume, this run's step 4 only; then 6)."""
    each = [r["loss"] for r in events(train(ckpt, "--steps", "6"))]
    log, save = tmp_path / "log", tmp_path / "s"
    common = ["--log-every", "2", "--log-dir", log, "--save", save]
    first = events(train(ckpt, "--steps", "5", "--save-every", "3", *common))
    assert [(r["step"], r["window"]) for r in first] == [(2, 2), (3, 1), (4, 1), (5, 1)]
    rest = events(train(ckpt, "--steps", "6", "--resume", save / "checkpoint-3", *common,
                        weights=False))
    assert [(r["step"], r["window"]) for r in rest] == [(4, 1), (6, 2)]
    assert [r["loss"] for r in rest] == [each[3], pytest.approx(_mean(each[4:6]),
                                                                rel=1e-12, abs=0)]
    logged = [json.loads(x) for x in (log / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["window"]) for r in logged] == [(2, 2), (3, 1), (4, 1), (6, 2)]


def test_a_diverged_step_stops_the_run_at_that_step_not_its_window_end():
    from types import SimpleNamespace

    from runtime.errors import RuntimeUserError
    from runtime.train.log_window import LogWindow
    from runtime.train.run import Run

    run = SimpleNamespace(losses=[], window=LogWindow(4, 8), request=SimpleNamespace(steps=8),
                          trainer=SimpleNamespace(step_metrics=dict),
                          _tokens_per_step=lambda: 32, _lr_at=lambda step: 1e-2)
    shown = []
    progress = SimpleNamespace(step=shown.append)
    Run._record(run, progress, 1, 2.5, 0.1)
    with pytest.raises(RuntimeUserError, match="the loss is nan at step 2"):
        Run._record(run, progress, 2, float("nan"), 0.1)
    assert run.losses == [2.5] and shown == []
