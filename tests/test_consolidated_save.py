"""`modulec train --save` on two gloo processes writes the consolidated weights tensor by
tensor (runtime/train/consolidated.py): under `--zero 1/2/3`, `--tp 2` and `--pp 2` rank
0's `model.safetensors` (and HF's shards and index under a small --max-shard-size) holds
the same bytes the whole-state write wrote (export_hf_tensors of the gathered masters and
safetensors' save_file), while the tensors it holds at once stay far below the model;
the sharded form loads in transformers and resumes on one process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.multiprocessing")
transformers = pytest.importorskip("transformers")

from tests import consolidated_workers  # noqa: E402
from tests.dist_testing import free_port, spawn  # noqa: E402
from tests.test_train import LLAMA, ckpt, losses, train  # noqa: E402,F401

RUNS = {"zero1": dict(zero=1), "zero2": dict(zero=2), "zero3": dict(zero=3),
        "tp2": dict(tp=2), "pp2": dict(pp=2, microbatches=2, max_shard_size=12_000)}


@pytest.fixture(scope="module")
def saved(ckpt, tmp_path_factory):
    """One spawn of two processes, a 1-step saved run per RUNS entry."""
    root = tmp_path_factory.mktemp("streamed")
    common = dict(file=Path(LLAMA), data=ckpt / "tokens.bin", seq=16, batch=1, steps=1,
                  device="cpu", lr=1e-2, fmt="json", hf_weights=ckpt / "hf")
    runs = [common | dict(save=root / name) | more for name, more in RUNS.items()]
    spawn(consolidated_workers.save_runs, nprocs=2,
             args=(2, [free_port() for _ in runs], runs, str(root / "probe")))
    counts = [json.loads((root / f"probe.{i}.json").read_text()) for i in range(len(runs))]
    return root, dict(zip(RUNS, counts))


def _reference(ckpt, folder: Path) -> dict[str, bytes]:
    """What the whole-state save wrote: the checkpoint's fp32 masters (its optimizer file
    or its shards joined) exported and written by safetensors' save_file, one file per
    file of the checkpoint (a sharded one: each shard's tensors)."""
    from safetensors.torch import save

    from runtime.hf_weights import export_hf_tensors
    from runtime.model import Model
    from runtime.train.checkpoint import read_optimizer

    model = Model.from_module(LLAMA, hf_weights=ckpt / "hf", dtype=torch.float32)
    schema = model.source.program(planned=False).weight_schema
    masters = read_optimizer(folder)["masters"]
    tensors = export_hf_tensors(schema, masters, layout=model.hf_layout)
    index = folder / "model.safetensors.index.json"
    files = {"model.safetensors": list(tensors)} if not index.exists() else {}
    for name, file in json.loads(index.read_text())["weight_map"].items() \
            if index.exists() else ():
        files.setdefault(file, []).append(name)
    return {file: save({n: tensors[n].contiguous().clone() for n in names},
                       metadata={"format": "pt"}) for file, names in files.items()}


@pytest.mark.parametrize("name", list(RUNS))
def test_the_streamed_weights_are_the_whole_state_writes_bytes(ckpt, saved, name):
    root, counts = saved
    folder = root / name / "checkpoint-1"
    want = _reference(ckpt, folder)
    assert (len(want) > 1) == (name == "pp2")  # pp2: HF's sharded form
    for file, data in want.items():
        assert (folder / file).read_bytes() == data, file
    total = sum(len(data) for data in want.values())
    # rank 0 never held the model: the live written tensors (a gathered bucket's views
    # counted as the whole bucket) stay at a bucket or a few tensors
    assert counts[name]["written"] >= total - 4096 * len(want)
    assert counts[name]["peak"] < total / 2, counts[name]


def test_the_sharded_form_loads_in_transformers_and_resumes(ckpt, saved, tmp_path):
    from safetensors.torch import load_file

    root, _ = saved
    folder = root / "pp2" / "checkpoint-1"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                      for i in range(1, len(shards) + 1)] and len(shards) > 1
    assert not (folder / "model.safetensors").exists()
    assert not (folder / "optimizer.safetensors").exists()  # the pipeline's shards hold it
    ours = {k: v for s in shards for k, v in load_file(str(folder / s)).items()}
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in ours.values())
    hf = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    theirs = hf.state_dict()
    assert all(torch.equal(theirs[k], ours[k]) for k in ours)
    # one process resumes the sharded checkpoint: weights from the index, optimizer from
    # the pipeline's shards; it goes on as a one-process run of the same rows
    rest = losses(train(ckpt, "--batch", "1", "--grad-accum", "2", "--steps", "2",
                        "--resume", folder, weights=False))
    assert len(rest) == 1


def test_a_streamed_file_is_save_files_bytes_in_any_write_order(tmp_path):
    """Every dtype the writer knows, empty and 0-d tensors, written in reverse order; the
    file gets the umask's permissions."""
    from safetensors.torch import save

    from runtime.hf_weights.stream import DTYPES, Spec, StreamFile

    generator = torch.Generator().manual_seed(0)
    tensors = {f"t{i}.{d}": (torch.randn(3, 5, generator=generator) * 9).to(d)
               for i, d in enumerate(DTYPES)}
    tensors |= {"empty": torch.zeros(0, 4), "scalar": torch.tensor(2.5, dtype=torch.bfloat16)}
    file = StreamFile(tmp_path / "x.safetensors",
                      [Spec(n, tuple(t.shape), t.dtype) for n, t in tensors.items()],
                      {"format": "pt"})
    for name in reversed(list(tensors)):
        file.write(name, tensors[name])
    file.close()
    assert (tmp_path / "x.safetensors").read_bytes() == save(tensors, metadata={"format": "pt"})
    assert [p.name for p in tmp_path.iterdir()] == ["x.safetensors"]  # no temp file left
    # the umask's permissions, as every other file the trainer writes (not mkstemp's 0600)
    from modulec.files import current_umask

    mode = (tmp_path / "x.safetensors").stat().st_mode & 0o777
    assert mode == 0o666 & ~current_umask()


def test_an_unfinished_or_wrong_write_leaves_no_file(tmp_path):
    from runtime.hf_weights.stream import Spec, StreamFile

    specs = [Spec("a", (2,), torch.float32), Spec("b", (3,), torch.float32)]
    file = StreamFile(tmp_path / "x.safetensors", specs)
    with pytest.raises(ValueError, match="header says"):
        file.write("a", torch.zeros(3))
    file.write("a", torch.zeros(2))
    with pytest.raises(ValueError, match="never written"):
        file.close()
    assert list(tmp_path.iterdir()) == []


def test_shards_split_as_huggingface_hub_splits():
    from huggingface_hub import split_torch_state_dict_into_shards

    from runtime.hf_weights.stream import Spec, split_shards

    sizes = [6, 6, 2, 6, 2, 2, 11, 1, 3, 5, 5]
    tensors = {f"w{i}": torch.zeros(n, dtype=torch.uint8) for i, n in enumerate(sizes)}
    hub = split_torch_state_dict_into_shards(tensors, max_shard_size=10)
    ours = split_shards([Spec(n, tuple(t.shape), t.dtype) for n, t in tensors.items()], 10)
    assert [[s.name for s in shard] for shard in ours] == \
        [list(names) for names in hub.filename_to_tensors.values()]


def test_max_shard_size_on_the_command_line(ckpt, tmp_path):
    """One process, `--max-shard-size 20KB`: HF's sharded form, which our loader reads
    back as the weights a resume starts from; a value that is not a size is a usage
    error, and the option without --save an error."""
    from runtime.model import Model

    losses(train(ckpt, "--steps", "1", "--save", tmp_path / "s", "--max-shard-size", "20KB"))
    folder = tmp_path / "s" / "checkpoint-1"
    assert not (folder / "model.safetensors").exists()
    assert len(list(folder.glob("model-*-of-*.safetensors"))) > 1
    ours = Model.from_module(LLAMA, hf_weights=folder, dtype=torch.float32)
    hf = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(1))
    assert torch.allclose(ours.forward(token_ids=ids.to(torch.int32))["logits"],
                          hf(input_ids=ids.long()).logits, atol=1e-4, rtol=1e-4)
    bad = train(ckpt, "--steps", "1", "--max-shard-size", "lots")
    assert bad.exit_code == 2 and "--max-shard-size" in bad.output
    unsaved = train(ckpt, "--steps", "1", "--max-shard-size", "1MB")  # not ignored
    assert unsaved.exit_code == 1 and "--max-shard-size needs --save DIR" in unsaved.output


def test_one_process_save_writes_the_whole_state_writes_bytes(ckpt, tmp_path):
    """save_checkpoint from a state held whole: model.safetensors (bf16) and
    optimizer.safetensors are the bytes of save_file of the whole exported weights and of
    the whole optimizer state, and the write path holds one parameter at a time."""
    from safetensors.torch import save

    from runtime.hf_weights import export_hf_tensors
    from runtime.hf_weights.schema import tied_targets
    from runtime.model import Model
    from runtime.train.checkpoint import FORMAT, save_checkpoint
    from tests.consolidated_workers import Probe

    model = Model.from_module(LLAMA, hf_weights=ckpt / "hf", dtype=torch.float32)
    schema = model.source.program(planned=False).weight_schema
    generator = torch.Generator().manual_seed(3)
    ties = tied_targets(schema)
    masters = {p: t for p, t in model.params.items() if p not in ties}
    moments = {part: {p: torch.randn(t.shape, generator=generator) for p, t in masters.items()}
               for part in ("exp_avg", "exp_avg_sq")}
    state = {"masters": masters, **moments, "step": 3}
    Probe.reset()
    folder = save_checkpoint(tmp_path, state, {"step": 3}, schema=schema,
                             layout=model.hf_layout, config=None, dtype=torch.bfloat16,
                             opener=Probe)
    weights = export_hf_tensors(schema, masters, layout=model.hf_layout)
    want = save({n: t.to(torch.bfloat16).contiguous().clone() for n, t in weights.items()},
                metadata={"format": "pt"})
    assert (folder / "model.safetensors").read_bytes() == want
    optimizer = {f"master.{p}": t for p, t in masters.items()}
    optimizer |= {f"{part}.{p}": t for part in moments for p, t in moments[part].items()}
    # two metadata keys: safetensors writes them in a Rust HashMap's order, which varies
    # from one call to the next; the rest of the header and the data are the same bytes
    assert _parts((folder / "optimizer.safetensors").read_bytes()) == \
        _parts(save(optimizer, metadata={"step": "3", "format": FORMAT}))
    # one parameter's master, moments and converted tensors at a time
    largest = max(t.numel() * 4 for t in masters.values())
    assert Probe.peak <= 4 * largest < Probe.written / 4, (Probe.peak, Probe.written)


def _parts(data: bytes) -> tuple:
    """(the header's metadata, its tensor entries in order, the data bytes)."""
    import struct

    size = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + size])
    return header.pop("__metadata__"), list(header.items()), data[8 + size:]
