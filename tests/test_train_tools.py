"""The training run's tools (issue 18 item 4): `--init random` (the standard init,
seeded), `--eval-data` (forward-only validation loss, CPU and the GPU step's forward
path), `--log-dir` (metrics.jsonl, TensorBoard when importable), `modulec report` (the
curves PNG) and `modulec data` (text / JSONL to a token file with a local tokenizer).
Tiny models on the CPU; the GPU checks are `-m cuda` at the end."""

from __future__ import annotations

import json
import sys
import types

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")
pytest.importorskip("tokenizers")

from tests.dist_testing import needs_gpus  # noqa: E402
from tests.test_cli import run  # noqa: E402

LLAMA = "std/models/llama.module"
TINY = dict(vocab_size=64, d_model=32, n_layers=2, num_heads=4, num_kv_heads=2, d_ff=48,
            max_seq=32)
SETS = [a for k, v in TINY.items() for a in ("--set", f"{k}={v}")]


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tools")
    np.random.default_rng(0).integers(0, 64, 4000).astype("<u2").tofile(folder / "train.bin")
    np.random.default_rng(1).integers(0, 64, 400).astype("<u2").tofile(folder / "eval.bin")
    return folder


def scratch(tokens, *args, device="cpu"):
    return run("train", LLAMA, "--init", "random", *SETS, "--data", tokens / "train.bin",
               "--seq", "16", "--batch", "2", "--device", device, "--lr", "1e-2",
               "--format", "json", *args)


def steps(result) -> list[dict]:
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    return [r for r in rows if r["event"] == "step"]


# ---------------------------------------------------------------------- --init random
def tiny_model(settings=TINY):
    from runtime.model import Model

    return Model.from_module(LLAMA, settings=settings, dtype=torch.float32)


def test_init_follows_the_hf_rules_and_the_seed():
    from runtime.train.init import initialize

    model = tiny_model()
    rules = initialize(model, seed=5, std=0.02)
    params = dict(model.params)
    assert rules["final_norm.weight"] == rules["blocks[1].ln2.weight"] == "ones"
    assert torch.equal(params["blocks[0].ln1.weight"], torch.ones(32))
    matrices = [p for p, r in rules.items() if r == "normal"]
    assert set(matrices) == {p for p, t in params.items() if t.dim() >= 2}
    values = torch.cat([params[p].flatten() for p in matrices])
    assert abs(float(values.mean())) < 2e-3 and float(values.std()) == pytest.approx(0.02, rel=0.05)
    again = tiny_model()
    initialize(again, seed=5, std=0.02)
    assert all(torch.equal(params[p], again.params[p]) for p in params)
    other = tiny_model()
    initialize(other, seed=6, std=0.02)
    assert not torch.equal(params["embedding"], other.params["embedding"])


def test_biases_start_at_zero():
    """A 1-d parameter no norm reads (Qwen2's q/k/v biases) is a bias: zeros."""
    from runtime.model import Model
    from runtime.train.init import initialize

    model = Model.from_module("std/models/qwen2.module", settings=TINY,
                              dtype=torch.float32)
    rules = initialize(model, seed=0)
    biases = [p for p in rules if "bias" in p]
    assert biases and all(rules[p] == "zeros" for p in biases)
    assert all(not model.params[p].any() for p in biases)


def test_layernorm_biases_start_at_zero():
    """LayerNorm reads its weight as the scale (ones) and its bias as a bias (zeros)."""
    from runtime.model import Model
    from runtime.train.init import initialize

    model = Model.from_module("std/models/gpt2.module", settings=dict(
        vocab_size=64, d_model=16, n_layers=1, num_heads=2, max_seq=8), dtype=torch.float32)
    rules = initialize(model, seed=0)
    assert rules["blocks[0].ln_1.weight"] == rules["ln_f.weight"] == "ones"
    assert rules["blocks[0].ln_1.bias"] == rules["ln_f.bias"] == "zeros"


def test_gemma_offset_norms_and_padding_row():
    """Gemma scales by `1 + w` (its norms start at w = 0, HF's init) and zeroes the
    embedding's padding row, as nn.Embedding(padding_idx=) does."""
    from runtime.model import Model
    from runtime.train.init import initialize

    model = Model.from_module("std/models/gemma.module", settings=dict(
        vocab_size=64, d_model=16, n_layers=1, num_heads=4, num_kv_heads=2, head_dim=8,
        d_ff=24, max_seq=16, padding_idx=3), dtype=torch.float32)
    rules = initialize(model, seed=0)
    assert rules["final_norm.weight"] == rules["blocks[0].ln1.weight"] == "zeros"
    embedding = model.params["embedding"]
    assert not embedding[3].any() and embedding[2].abs().sum() > 0


def test_scratch_config_is_what_transformers_reads():
    from runtime.train.init import scratch_config, scratch_layout

    transformers = pytest.importorskip("transformers")
    program = tiny_model().source.program(planned=False)
    config = scratch_config(program, 0.02)
    hf = transformers.AutoConfig.for_model(**config)
    assert (hf.model_type, hf.hidden_size, hf.num_key_value_heads, hf.vocab_size) == \
        ("llama", 32, 2, 64)
    layout = scratch_layout(program.weight_schema, config)
    assert layout["blocks[1].attention.qkv_weight"] == [32, 16, 16]
    assert layout["blocks[0].mlp.up_weight"] == [48, 48]


@pytest.mark.parametrize("args, message", [
    (["--hf-weights", "."], "--init random starts from scratch; --hf-weights"),
    (["--eval-every", "2"], "--eval-every need --eval-data FILE"),
    (["--eval-data", "x.bin"], "--eval-data needs --eval-every K"),
])
def test_option_mistakes(tokens, args, message):
    result = scratch(tokens, "--steps", "1", *args)
    assert result.exit_code == 1 and message in result.output, result.output
    assert "Traceback" not in result.output


def test_config_sizes_a_scratch_model_and_its_init(tokens, tmp_path):
    """--config sizes the model (hidden 32, vocab 64) and gives the init its std
    (initializer_range 1.0: logits far from uniform, a loss well above ln 64)."""
    config = dict(model_type="llama", vocab_size=64, hidden_size=32, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                  max_position_embeddings=32, initializer_range=1.0)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    result = run("train", LLAMA, "--init", "random", "--config", path, "--data",
                 tokens / "train.bin", "--seq", "16", "--batch", "2", "--steps", "1",
                 "--device", "cpu", "--format", "json")
    assert steps(result)[0]["loss"] > 10


def test_config_needs_init_random(tokens):
    config = tokens / "config.json"
    config.write_text("{}")
    result = run("train", LLAMA, "--config", config, "--data", tokens / "train.bin",
                 "--seq", "16", "--batch", "2", "--steps", "1", "--device", "cpu")
    assert result.exit_code == 1 and "give it with --init random" in result.output


# ---------------------------------------------------------------------- a whole run
def test_scratch_run_evaluates_logs_saves_and_resumes(tokens, tmp_path):
    """3 steps from scratch with eval every 2 (and after the last), a metrics log and
    checkpoints; then step 3 again from checkpoint-2 into the same log: the log holds one
    record per step, and the resumed step's loss and eval loss are the first run's."""
    log, save = tmp_path / "log", tmp_path / "save"
    common = ["--steps", "3", "--eval-data", tokens / "eval.bin", "--eval-every", "2",
              "--eval-batches", "2", "--log-dir", log]
    first = steps(scratch(tokens, "--seed", "4", "--save", save, "--save-every", "2",
                          *common))
    assert [("eval_loss" in r) for r in first] == [False, True, True]
    records = [json.loads(x) for x in (log / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert {"loss", "lr", "tokens_per_s", "peak_bytes", "time"} <= set(records[0])
    assert records[1]["eval_loss"] == first[1]["eval_loss"]
    assert 3.5 < records[0]["loss"] < 4.7  # about ln(64) = 4.16 from a small init
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(save / "checkpoint-3")
    assert hf.config.hidden_size == 32 and hf.config.initializer_range == 0.02
    resumed = run("train", LLAMA, "--data", tokens / "train.bin", "--seq", "16", "--batch",
                  "2", "--device", "cpu", "--lr", "1e-2", "--format", "json", "--seed", "4",
                  "--resume", save / "checkpoint-2", *common)
    again = steps(resumed)
    assert [r["step"] for r in again] == [3]
    assert again[0]["loss"] == first[2]["loss"]
    assert again[0]["eval_loss"] == first[2]["eval_loss"]
    records = [json.loads(x) for x in (log / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]


# ---------------------------------------------------------------------- eval paths
def test_gpu_forward_only_path_is_the_loss_and_keeps_nothing():
    """runtime/cuda/evaluate.py's interpreter, run here on the reference kernels in
    float32: the loss of the fused-head split equals the model's own forward + loss, and
    no frame keeps an activation (every value left is a stand-in)."""
    from runtime.cuda import evaluate as gpu_eval
    from runtime.cuda.lm_head import logits_cross_entropy, split_head
    from runtime.kernels import KERNELS
    from runtime.train.init import initialize

    model = tiny_model()
    initialize(model, seed=1, std=0.3)
    window = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    ids, labels = window[:, :-1].to(torch.int32), window[:, 1:]
    expected, _ = logits_cross_entropy(model.forward(token_ids=ids)["logits"], labels)
    program = model.source.program_for({"token_ids": ids})
    split = split_head(program.graph)
    # the TrainStep stand-in carries every field eval_loss reads: ignore_index came with
    # packed sequences (58ef9d1: TrainStep.ignore_index, -100 unless the step is given one),
    # zero with data parallel (None: one process; ZeRO-3 gathers through it)
    step = types.SimpleNamespace(graph=split.graph, compute=model.params, kernels=KERNELS,
                                 dtype=torch.float32, input_names=program.input_names(),
                                 split=split, chunk_rows=5, ignore_index=-100, zero=None)
    assert float(gpu_eval.eval_loss(step, ids, labels)) == pytest.approx(float(expected),
                                                                         rel=1e-6)
    step.ignore_index = int(labels[0, 0])  # labels equal to it leave the loss
    left_out, _ = logits_cross_entropy(model.forward(token_ids=ids)["logits"], labels,
                                       ignore_index=step.ignore_index)
    assert float(gpu_eval.eval_loss(step, ids, labels)) == pytest.approx(float(left_out),
                                                                         rel=1e-6)
    assert float(left_out) != pytest.approx(float(expected), rel=1e-6)
    interpreter = gpu_eval.forward_interpreter(step)
    outputs, frame = interpreter.forward([ids])
    assert outputs[0].shape == (2, 8, 32)
    kept = [t for t in frame.env.values() if isinstance(t, torch.Tensor) and t.numel() > 1
            and 0 not in t.stride()]
    assert not kept and not frame.children


def test_eval_data_in_file_order_and_its_checks(tokens):
    from runtime.errors import RuntimeUserError
    from runtime.train.evaluate import EvalData

    data = EvalData(tokens / "eval.bin", "uint16", 16, 2, 64)
    assert data.batches == (399 // 16) // 2 == 12
    raw = np.fromfile(tokens / "eval.bin", "<u2").astype(np.int64)
    assert torch.equal(data.batch_at(1)[1], torch.from_numpy(raw[48:65]))
    with pytest.raises(RuntimeUserError, match="holds 12 whole batches"):
        EvalData(tokens / "eval.bin", "uint16", 16, 2, 64, batches=13)
    with pytest.raises(RuntimeUserError, match="vocab_size is 8"):
        EvalData(tokens / "eval.bin", "uint16", 16, 2, 8)


# ---------------------------------------------------------------------- metrics log
class FakeWriter:
    scalars: list = []

    def __init__(self, log_dir):
        self.log_dir = log_dir

    def add_scalar(self, tag, value, step):
        FakeWriter.scalars.append((tag, value, step))

    def flush(self):
        pass

    def close(self):
        pass


def test_metrics_log_with_and_without_tensorboard(tmp_path, monkeypatch):
    from runtime.train.metrics import MetricsLog, read_metrics

    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = FakeWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    FakeWriter.scalars = []
    with MetricsLog(tmp_path / "a") as log:
        log.write({"step": 1, "loss": 2.5, "lr": 1e-3, "eval_loss": float("nan")})
        log.write({"step": 2, "loss": 2.0, "lr": 1e-3, "eval_loss": 2.25})
        assert not log.notices
    assert ("train/loss", 2.0, 2) in FakeWriter.scalars
    assert ("eval/loss", 2.25, 2) in FakeWriter.scalars
    assert [r.get("eval_loss") for r in read_metrics(tmp_path / "a")] == [None, 2.25]
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # not importable
    with MetricsLog(tmp_path / "a", start=1) as log:  # a resume at step 1
        assert len(log.notices) == 1 and "tensorboard is not installed" in log.notices[0]
        log.write({"step": 2, "loss": 1.5})
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "a")] == [(1, 2.5),
                                                                              (2, 1.5)]


# ---------------------------------------------------------------------- report
def test_report_draws_the_curves(tmp_path):
    from PIL import Image

    from modulec.pictures.curves import COLORS, layout

    records = [{"step": s, "loss": 8.0 - 0.02 * s, "tokens_per_s": 1000.0 + s}
               for s in range(1, 201)]
    for s in (50, 100, 150, 200):
        records[s - 1]["eval_loss"] = 8.2 - 0.02 * s
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records)
                                          + "{not json\n")
    result = run("report", folder, "-o", tmp_path / "c.png")
    assert result.exit_code == 0, result.output
    image = Image.open(tmp_path / "c.png").convert("RGB")
    assert image.size == (960, 680)
    assert len(image.getcolors(1 << 16)) > 20  # not blank: axes, text, curves
    panels = layout(records)

    def near(panel, step, value, color):
        x, y = panels[panel].point(step, value)
        want = tuple(int(color[i:i + 2], 16) for i in (1, 3, 5))
        return any(image.getpixel((round(x) + dx, round(y) + dy)) == want
                   for dx in (-1, 0, 1) for dy in (-1, 0, 1))

    assert near("loss", 25, 8.0 - 0.5, COLORS["loss"])
    assert near("loss", 100, 8.2 - 2.0, COLORS["eval_loss"])
    assert near("tokens_per_s", 120, 1120.0, COLORS["tokens_per_s"])
    assert not near("loss", 25, 3.0, COLORS["loss"])


def test_report_without_metrics(tmp_path):
    result = run("report", tmp_path)
    assert result.exit_code == 1 and "holds no metrics.jsonl" in result.output


# ---------------------------------------------------------------------- data
@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from runtime.train.bpe import train_bpe

    texts = [f"The quick brown fox {i} jumps over the lazy dog." for i in range(100)]
    return train_bpe(texts, 300, tmp_path_factory.mktemp("tok") / "tokenizer")


def test_data_tokenizes_text_and_jsonl(tokenizer, tmp_path):
    from tokenizers import Tokenizer

    (tmp_path / "a.jsonl").write_text(
        json.dumps({"text": "The quick fox."}) + "\n\n" + json.dumps({"text": "lazy dog"}) + "\n")
    (tmp_path / "b.txt").write_text("brown fox\njumps")
    result = run("data", tmp_path / "a.jsonl", tmp_path / "b.txt", "-o", tmp_path / "t.bin",
                 "--tokenizer", tokenizer)
    assert result.exit_code == 0, result.output
    assert "(3 documents, separator id 0)" in result.output
    ids = np.fromfile(tmp_path / "t.bin", "<u2").tolist()
    fast = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    expected = []
    for text in ("The quick fox.", "lazy dog", "brown fox\njumps"):
        expected += fast.encode(text, add_special_tokens=False).ids + [0]
    assert ids == expected


def test_data_errors(tokenizer, tmp_path):
    good = tmp_path / "good.txt"
    good.write_text("fox")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "ok"}) + "\n{oops\n")
    out = tmp_path / "t.bin"
    missing = run("data", good, "-o", out, "--tokenizer", tmp_path / "nope")
    assert missing.exit_code == 1 and "--tokenizer" in missing.output and \
        "does not exist" in missing.output
    broken = run("data", bad, "-o", out, "--tokenizer", tokenizer)
    assert broken.exit_code == 1 and f"{bad}:2: not a JSON line" in broken.output
    field = run("data", bad, "-o", out, "--tokenizer", tokenizer, "--field", "body")
    assert field.exit_code == 1 and f'{bad}:1: no field "body"' in field.output
    # nothing half-written, no temp file left beside it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "good.txt"]


def test_data_refuses_a_vocabulary_larger_than_the_dtype(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    big = Tokenizer(models.WordLevel({f"w{i}": i for i in range(70000)}, unk_token="w0"))
    big.pre_tokenizer = pre_tokenizers.Whitespace()
    folder = tmp_path / "big"
    folder.mkdir()
    big.save(str(folder / "tokenizer.json"))
    (tmp_path / "x.txt").write_text("w1 w69999")
    args = ["data", tmp_path / "x.txt", "-o", tmp_path / "t.bin", "--tokenizer", folder,
            "--doc-sep", "none"]
    refused = run(*args, "--dtype-tokens", "uint16")
    assert refused.exit_code == 1 and "70,000 ids: more than uint16 holds" in refused.output
    fine = run(*args)
    assert fine.exit_code == 0 and "as uint32" in fine.output
    assert np.fromfile(tmp_path / "t.bin", "<u4").tolist() == [1, 69999]
    no_eos = run("data", tmp_path / "x.txt", "-o", tmp_path / "t.bin", "--tokenizer", folder)
    assert no_eos.exit_code == 1 and "no end-of-text token" in no_eos.output


# ---------------------------------------------------------------------- GPU (-m cuda)


GPU_SETS = [a for k, v in dict(TINY, d_model=128, d_ff=256).items()
            for a in ("--set", f"{k}={v}")]


def gpu_scratch(tokens, *args, device="cuda"):
    return run("train", LLAMA, "--init", "random", *GPU_SETS, "--data", tokens / "train.bin",
               "--seq", "16", "--batch", "2", "--device", device, "--format", "json", *args)


def masters(folder) -> dict:
    from safetensors.torch import load_file

    tensors = load_file(str(folder / "optimizer.safetensors"))
    return {k: v for k, v in tensors.items() if k.startswith("master.")}


@needs_gpus(1)
def test_cuda_scratch_init_is_the_cpus_and_evaluates(tokens, tmp_path):
    """The same seed gives the same weights on both devices (one step at lr 0 saves the
    init unchanged: the masters are bit for bit the CPU's), and the GPU's forward-only
    eval loss on them is the CPU's within bf16."""
    args = ["--steps", "1", "--lr", "0", "--seed", "9", "--eval-data", tokens / "eval.bin",
            "--eval-every", "1", "--eval-batches", "3"]
    cpu = steps(gpu_scratch(tokens, *args, "--save", tmp_path / "cpu", device="cpu"))
    gpu = steps(gpu_scratch(tokens, *args, "--save", tmp_path / "gpu"))
    a, b = masters(tmp_path / "cpu" / "checkpoint-1"), masters(tmp_path / "gpu" / "checkpoint-1")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert gpu[0]["eval_loss"] == pytest.approx(cpu[0]["eval_loss"], rel=1e-2)
    assert gpu[0]["loss"] == pytest.approx(cpu[0]["loss"], rel=1e-2)


@needs_gpus(1)
def test_cuda_evaluation_leaves_the_training_curve_alone(tokens):
    """Evaluating every 2 steps (eagerly, between replays of the captured graph) gives
    the curve of the run without evaluation, within the backward's bf16 noise."""
    args = ["--steps", "6", "--lr", "1e-3", "--seed", "2"]
    plain = steps(gpu_scratch(tokens, *args))
    evaluated = steps(gpu_scratch(tokens, *args, "--eval-data", tokens / "eval.bin",
                                  "--eval-every", "2", "--eval-batches", "2"))
    assert [("eval_loss" in r) for r in evaluated] == [False, True] * 3
    assert [r["loss"] for r in evaluated] == pytest.approx([r["loss"] for r in plain],
                                                           rel=5e-3)


@needs_gpus(1)
def test_cuda_eval_loss_is_the_steps_loss_before_its_update():
    """On the captured step: eval_loss(batch) equals the loss the next replay reports for
    that batch (computed before its update), within bf16 noise."""
    from runtime.cuda.evaluate import eval_loss
    from runtime.cuda.step import TrainStep

    step = TrainStep.from_module(LLAMA, dict(TINY, vocab_size=512, d_model=128,
                                             max_seq=64), batch=2, seq=64).init_random(0)
    batches = [torch.randint(0, 512, (2, 65), device="cuda") for _ in range(4)]
    step(batches[0][:, :-1].int(), batches[0][:, 1:])
    step.set_batch(batches[1][:, :-1].int(), batches[1][:, 1:])
    step.capture(warmup=1)
    for window in batches[2:]:
        ids, labels = window[:, :-1].int().contiguous(), window[:, 1:].contiguous()
        before = float(eval_loss(step, ids, labels))
        assert float(step(ids, labels)) == pytest.approx(before, rel=2e-3)


def test_make_corpus_small(tmp_path, monkeypatch):
    """benchmarks/data/make_corpus.py at a small size: a tokenizer, train and eval token
    files whose ids decode back to the documents, and a manifest. Run from another folder
    with a relative OUT (its `modulec data` steps run in the repository root, where a
    relative OUT was not found: a traceback)."""
    import importlib.util
    from pathlib import Path

    from tokenizers import Tokenizer

    script = Path("benchmarks/data/make_corpus.py").resolve()
    spec = importlib.util.spec_from_file_location("make_corpus", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.chdir(tmp_path)
    assert module.main(["corpus", "--vocab", "400", "--max-mb", "0.3"]) == 0
    tmp_path = tmp_path / "corpus"
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["documents"]["train"] > 0 and "train.bin" in manifest["files"]
    ids = np.fromfile(tmp_path / "train.bin", "<u2")
    assert 0 < ids.max() < 400 and (ids == 0).sum() == manifest["documents"]["train"]
    first = json.loads((tmp_path / "train.jsonl").read_text().splitlines()[0])["text"]
    fast = Tokenizer.from_file(str(tmp_path / "tokenizer" / "tokenizer.json"))
    end = int(np.argmax(ids == 0))
    assert fast.decode(ids[:end].tolist()) == first


def test_init_under_tp_gives_each_rank_its_slice_of_the_one_process_init():
    """`--init random --tp 2`: each rank's weights are its slices of what the same seed
    gives one process (a rank draws the whole model and keeps its part)."""
    from runtime.model import Model
    from runtime.tensor_parallel import unshard_params
    from runtime.train.init import initialize

    settings = TINY

    one = tiny_model(settings)
    initialize(one, seed=3, std=0.02)
    ranks = []
    for rank in range(2):
        model = Model.from_module(LLAMA, settings=settings, dtype=torch.float32,
                                  tensor_parallel=2, tp_rank=rank)
        initialize(model, seed=3, std=0.02)
        ranks.append(dict(model.params))
    program = Model.from_module(LLAMA, settings=settings, dtype=torch.float32,
                                tensor_parallel=2).source.program(planned=False)
    whole = unshard_params(ranks, program)
    assert set(whole) == set(one.params)
    for path, value in one.params.items():
        assert torch.equal(whole[path], value), path
    assert ranks[0]["blocks[0].attention.qkv_weight"].shape[0] * 2 == \
        one.params["blocks[0].attention.qkv_weight"].shape[0]


@pytest.mark.parametrize("name", ["qwen3", "gemma"])
def test_init_under_tp_keeps_the_norm_scales_and_the_padding_row(name):
    """Qwen3's q_norm / k_norm are read through `tp_copy` in a --tp program (still ones,
    not zeros as an unknown 1-d parameter); Gemma's vocabulary-split table zeroes its
    padding row (40: rank 1's rows) as one process does."""
    from runtime.model import Model
    from runtime.tensor_parallel import unshard_params
    from runtime.train.init import initialize
    from tests.runtime_models import TINY as MODELS

    path, sizes = MODELS[name]
    settings = {k: str(v) for k, v in sizes.items()} | (
        {"padding_idx": "40"} if name == "gemma" else {})
    one = Model.from_module(path, settings=settings, dtype=torch.float32)
    initialize(one, seed=3)
    ranks = [Model.from_module(path, settings=settings, dtype=torch.float32,
                               tensor_parallel=2, tp_rank=rank) for rank in range(2)]
    for model in ranks:
        initialize(model, seed=3)
    whole = unshard_params([dict(m.params) for m in ranks], ranks[0].source.program(
        planned=False))
    assert set(whole) == set(one.params)
    for path_, value in one.params.items():
        assert torch.equal(whole[path_], value), path_
    if name == "qwen3":
        assert bool((ranks[1].params["blocks[1].attention.q_norm"] == 1).all())
    else:
        assert not whole["embedding"][40].any() and whole["embedding"][39].any()
