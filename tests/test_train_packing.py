"""Packed sequences (`modulec train --doc-sep ID`, runtime/train/packing.py): a window
of three documents gives the loss and every gradient of the three run separately (CPU,
float64), positions restart per document, cross-document targets are ignored, and the
options work end to end on a tiny model or are refused with one clear error."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")

from tests.test_cli import run  # noqa: E402

LLAMA = "std/models/llama.module"
QWEN3 = "std/models/qwen3.module"
GPT2 = "std/models/gpt2.module"
SEP = 1
SIZES = dict(vocab_size=32, d_model=16, n_layers=2, num_heads=4, num_kv_heads=2, d_ff=24,
             max_seq=32)
GPT2_SIZES = dict(vocab_size=32, d_model=16, n_layers=2, num_heads=4, max_seq=32)


def _model(path, settings):
    from runtime.model import Model

    return Model.from_module(path, settings=settings, dtype=torch.float64).init_random(
        0, std=0.3)


def _documents():
    """Three documents of 4, 6 and 3 tokens, each followed by SEP (as `modulec data` writes)."""
    rng = np.random.default_rng(0)
    return [list(rng.integers(2, 32, n)) + [SEP] for n in (4, 6, 3)]


def _token_losses(model, output, inputs, labels, positions=None, documents=None):
    """Sum of the float64 token losses over labels != -100 and the count of those, and
    the parameters' gradients of that sum (the model's forward and backward)."""
    from runtime.inputs import fed_inputs
    from runtime.kernels.documents import packed

    names = model.source.program(planned=False).input_names()
    with packed(documents):
        logits = model.forward(**fed_inputs(names, inputs, positions))[output]
        flat = logits.reshape(-1, logits.shape[-1]).detach().requires_grad_()
        total = torch.nn.functional.cross_entropy(flat, labels.reshape(-1),
                                                  ignore_index=-100, reduction="sum")
        total.backward()
        grads = model.backward(**{output: flat.grad.reshape(logits.shape)}).params
    return total.detach(), int((labels != -100).sum()), grads


@pytest.mark.parametrize("path,settings", [
    (LLAMA, SIZES), (QWEN3, dict(SIZES, head_dim=8)), (GPT2, GPT2_SIZES)],
    ids=["llama", "qwen3-qk-norm-rope", "gpt2-position-ids"])
def test_a_packed_window_equals_its_documents_run_one_by_one(path, settings):
    """The packed mean (the sum of the window's kept token losses / their count) and its
    gradients equal the documents' summed token losses and gradients / the same count."""
    from runtime.train.packing import Packing, split_batch

    model = _model(path, settings)
    output = model.source.program(planned=False).output_names()[0]
    docs = _documents()
    window = torch.tensor([sum(docs, [])])  # 5 + 7 + 4 = 16 tokens: T = 15
    tokens, labels, documents = split_batch(window, Packing(SEP))
    packed_sum, packed_n, packed_grads = _token_losses(
        model, output, tokens, labels, documents.positions, documents)
    alone_sum, alone_n, alone_grads = 0.0, 0, {}
    for doc in docs:  # each with its own SEP as its last target
        one = torch.tensor([doc])
        part = _token_losses(model, output, one[:, :-1].to(torch.int32), one[:, 1:])
        alone_sum, alone_n = alone_sum + part[0], alone_n + part[1]
        for p, g in part[2].items():
            alone_grads[p] = alone_grads[p] + g if p in alone_grads else g
    assert packed_n == alone_n == 15 - 2  # the 2 targets after a separator are ignored
    torch.testing.assert_close(packed_sum / packed_n, alone_sum / alone_n, rtol=1e-12,
                               atol=1e-12)
    assert packed_grads.keys() == alone_grads.keys()
    for p in packed_grads:
        torch.testing.assert_close(packed_grads[p], alone_grads[p], rtol=1e-10, atol=1e-12,
                                   msg=p)
    if path == GPT2:  # its head is tied to wte, which init_random leaves two tensors
        return
    # the trainer's own step (its cross-entropy computes in fp32: fp32 tolerances)
    loss, grads = _trainer(model).loss_and_gradients(window)
    torch.testing.assert_close(loss.double(), alone_sum / alone_n, rtol=1e-6, atol=1e-7)
    for p, g in grads.items():
        torch.testing.assert_close(g, alone_grads[p] / alone_n, rtol=1e-5, atol=1e-7, msg=p)


def _trainer(model):
    from runtime.train.backends import CPUTrainer
    from runtime.train.optim import AdamW
    from runtime.train.packing import Packing

    trainer = CPUTrainer(model, 1, 15, AdamW(lr=0.0), packing=Packing(SEP))
    trainer.loss_and_gradients = trainer._loss_and_gradients
    return trainer


def test_without_the_mask_the_packed_window_differs():
    """The test above can fail: unmasked (no documents), the same window's loss moves."""
    from runtime.train.packing import Packing, split_batch

    model = _model(LLAMA, SIZES)
    output = model.source.program(planned=False).output_names()[0]
    tokens, labels, documents = split_batch(torch.tensor([sum(_documents(), [])]),
                                            Packing(SEP))
    masked = _token_losses(model, output, tokens, labels, documents.positions, documents)
    plain = _token_losses(model, output, tokens, labels)
    assert abs(float(masked[0] - plain[0])) > 1e-6


def test_positions_restart_and_cross_document_targets_are_ignored():
    from runtime.train.packing import Packing, split_batch

    window = torch.tensor([[5, 6, SEP, 7, SEP, 8, 9, 10, SEP],
                           [SEP, 3, 4, 5, 6, 7, 8, 9, 2]])
    tokens, labels, documents = split_batch(window, Packing(SEP, ignore_index=-7))
    assert documents.positions.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2],
                                            [0, 0, 1, 2, 3, 4, 5, 6]]
    assert documents.segments.tolist() == [[0, 0, 0, 1, 1, 2, 2, 2],
                                           [0, 1, 1, 1, 1, 1, 1, 1]]
    assert labels.tolist() == [[6, SEP, -7, SEP, -7, 9, 10, SEP],
                               [-7, 4, 5, 6, 7, 8, 9, 2]]
    assert tokens.dtype == torch.int32 and documents.positions.dtype == torch.int32
    # unpacked: exactly the windows' plain split
    plain = split_batch(window, None)
    assert plain[2] is None and torch.equal(plain[1], window[:, 1:])


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("packed")
    rng = np.random.default_rng(1)
    docs = [list(rng.integers(2, 64, int(n))) + [SEP] for n in rng.integers(3, 12, 120)]
    np.asarray(sum(docs, []), dtype="<u2").tofile(folder / "tokens.bin")
    return folder / "tokens.bin"


def _train(data, *args, scratch=True):
    return run("train", LLAMA, *(["--init", "random"] if scratch else []), "--set",
               "vocab_size=64", "--set",
               "d_model=16", "--set", "n_layers=1", "--set", "num_heads=2", "--set",
               "num_kv_heads=1", "--set", "d_ff=16", "--set", "max_seq=32", "--data", data,
               "--seq", "16", "--batch", "2", "--steps", "3", "--device", "cpu",
               "--format", "json", *args)


def _losses(result) -> list[float]:
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    return [r["loss"] for r in rows if r["event"] == "step"]


def test_doc_sep_end_to_end(data):
    packed = _losses(_train(data, "--doc-sep", str(SEP)))
    plain = _losses(_train(data))
    assert len(packed) == len(plain) == 3
    assert packed != plain  # the same windows, masked and with the targets left out
    again = _losses(_train(data, "--doc-sep", str(SEP), "--ignore-index", "-1"))
    assert again == packed  # the label value is a name only


def test_doc_sep_resumes_exactly_and_a_resume_must_keep_it(data, tmp_path):
    packed = _losses(_train(data, "--doc-sep", str(SEP)))
    first = _train(data, "--doc-sep", str(SEP), "--save", tmp_path / "run", "--steps", "2")
    assert _losses(first) == packed[:2]
    rest = _train(data, "--doc-sep", str(SEP), "--resume", tmp_path / "run", scratch=False)
    assert _losses(rest) == packed[2:]
    unpacked = _train(data, "--resume", tmp_path / "run", scratch=False)
    assert unpacked.exit_code == 1 and "--doc-sep is not given, but" in unpacked.output
    # and the evaluation packs its windows too
    evaluated = _train(data, "--doc-sep", str(SEP), "--eval-data", data, "--eval-every", "3",
                       "--eval-batches", "1", "--steps", "1")
    assert evaluated.exit_code == 0, evaluated.output


@pytest.mark.parametrize("args,message", [
    (["--ignore-index", "-1"], "--ignore-index -1 needs --doc-sep"),
    (["--doc-sep", "64"], "--doc-sep 64 is not a token id of the model"),
    (["--doc-sep", "-2"], "--doc-sep -2 is not a token id"),
    (["--doc-sep", "1", "--ignore-index", "5"], "--ignore-index 5 is a token id"),
    # --pp packs (tests/test_pipeline_packed_eval.py): one process is the launch's mistake
    (["--doc-sep", "1", "--pp", "2"], "--pp 2 runs one stage per process; this is one "
                                      "process"),
    # --tp packs (tests/test_tp_packed.py): one process is the launch's mistake
    (["--doc-sep", "1", "--tp", "2"], "--tp 2 must divide the 1 processes"),
])
def test_packing_mistakes_are_one_clear_error(data, args, message):
    result = _train(data, *args)
    assert result.exit_code == 1 and message in result.output
    assert "Traceback" not in result.output


def test_doc_sep_on_cuda_packs_in_one_process_data_tensor_or_pipeline_parallel(data):
    """The GPU step packs (tests/test_cuda_packed.py), also data parallel (--zero:
    tests/test_dist_packed_eval.py), tensor parallel (--tp: tests/test_tp_packed.py,
    tests/test_cuda_tp_packed.py) and pipeline parallel (--pp, alone or with --tp:
    tests/test_pipeline_packed_eval.py, tests/test_cuda_pipeline_packed_eval.py)."""
    from runtime.train.packing import check_options
    from runtime.train.run import Request

    request = Request(file=LLAMA, data=data, seq=16, batch=2, steps=1, device="cuda",
                      doc_sep=SEP)
    check_options(request)
    check_options(Request(file=LLAMA, data=data, seq=16, batch=2, steps=1, device="cuda",
                          doc_sep=SEP, zero=1))
    for option in (dict(tp=2), dict(tp=2, zero=1)):
        check_options(Request(file=LLAMA, data=data, seq=16, batch=2, steps=1,
                              device="cuda", doc_sep=SEP, **option))
    for option in (dict(pp=2), dict(pp=2, tp=2)):
        check_options(Request(file=LLAMA, data=data, seq=16, batch=2, steps=1,
                              device="cuda", doc_sep=SEP, **option))


MIXER = """\
model Mixer(vocab: int = 16, d: int = 8):
  params:
    embedding: [vocab, d]
    lm_head: [vocab, d]
  forward:
    in: token_ids: [B, T, int32]
    out: logits: [B, T, vocab]
    graph:
      (token_ids, embedding) -> embedding() -> h
      h -> softmax(dim=1) -> mixed
      mixed -> matmul(lm_head, transpose=NT) -> logits
"""


def test_a_model_mixing_tokens_outside_attention_is_refused(tmp_path, data):
    """softmax over T would carry one document into another: refused, not masked wrongly."""
    from runtime.errors import RuntimeUserError
    from runtime.model import Model
    from runtime.train.packing import packing_for
    from runtime.train.run import Request

    path = tmp_path / "mixer.module"
    path.write_text(MIXER)
    program = Model.from_module(path, dtype=torch.float32).source.program(planned=False)
    request = Request(file=path, data=data, seq=8, batch=1, steps=1, device="cpu",
                      doc_sep=SEP)
    with pytest.raises(RuntimeUserError, match="mixes tokens through softmax"):
        packing_for(request, 16, program)
