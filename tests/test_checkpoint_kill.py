"""kill -9 during a checkpoint save (issue 16): a forked process saving a tiny model's
checkpoint is killed with SIGKILL at every file-system step of the save (each rename,
fsync, chmod, folder removal, temporary folder, and halfway through writing each
safetensors file), and at seeded random moments from outside. After each kill:

- the save folder resolves (`find_checkpoint`) to a complete checkpoint whose weights are
  exactly the previous save's or the new one's; every `checkpoint-*` folder there is
  complete (no half-written file is accepted);
- after `recover` (what the next save does first), `latest` names a complete folder;
- the next save succeeds and leaves only checkpoints and `latest`.

Two cases: a new step after an earlier one, and re-saving the same step."""

from __future__ import annotations

import os
import random
import shutil
import signal
import tempfile
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

if not hasattr(os, "fork"):
    pytest.skip("needs os.fork", allow_module_level=True)

from runtime.model import Model  # noqa: E402
from runtime.train import checkpoint as C  # noqa: E402
from tests.runtime_models import DENSE  # noqa: E402


# the fused parameters' parts (q, k, v and gate, up) at DENSE's sizes
LAYOUT = {"blocks[{i}].attention.qkv_weight": [32, 16, 16], "blocks[{i}].mlp.up_weight": [48, 48]}


@pytest.fixture(scope="module")
def tiny():
    model = Model.from_module("std/models/llama.module", settings=DENSE)
    program = model.source.program(planned=False)
    return program.weight_schema, model.parameter_shapes()


def _state(shapes: dict, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    draw = {part: {p: torch.randn(s, generator=generator) for p, s in shapes.items()}
            for part in ("masters", "exp_avg", "exp_avg_sq")}
    return draw | {"step": seed}


def _save(root, tiny, state, step):
    schema, _ = tiny
    return C.save_checkpoint(root, state, {"step": step, "seed": state["step"]},
                             schema=schema, layout=LAYOUT, config=None, dtype=torch.float32)


# ====================================================================== the killed child
class _Steps:
    """Counts the save's file-system steps; SIGKILLs the process at step `kill_at`."""

    def __init__(self, kill_at: int):
        self.kill_at, self.count = kill_at, 0

    def hit(self):
        self.count += 1
        if self.count == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def wrap(self, function):
        def wrapped(*args, **kwargs):
            self.hit()
            return function(*args, **kwargs)
        return wrapped

    def halfway(self, write):
        """A streamed file's write, killable once: halfway through its tensors."""
        def wrapped(file, name, tensor):
            if len(file.left) == (len(file.specs) + 1) // 2:
                self.hit()
            return write(file, name, tensor)
        return wrapped

    def save_file(self, tensors, path, metadata=None):
        """safetensors' save_file, killable before, halfway through and after the bytes."""
        from safetensors.torch import save

        data = save(tensors, metadata=metadata)
        self.hit()
        with open(path, "wb") as stream:
            stream.write(data[:len(data) // 2])
            stream.flush()
            self.hit()
            stream.write(data[len(data) // 2:])


def _patch(steps: _Steps) -> None:
    import safetensors.torch

    import runtime.hf_weights.stream as stream

    for module, name in ((os, "replace"), (os, "fsync"), (os, "chmod"), (shutil, "rmtree"),
                         (tempfile, "mkdtemp")):
        setattr(module, name, steps.wrap(getattr(module, name)))
    safetensors.torch.save_file = steps.save_file
    stream.StreamFile.write = steps.halfway(stream.StreamFile.write)


def _in_child(work, kill_at: int, count_file=None) -> int:
    """Fork; the child runs `work` killed at step `kill_at`, writes its step count to
    `count_file` when it finishes. Returns the child's wait status."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            steps = _Steps(kill_at)
            _patch(steps)
            work()
            if count_file is not None:
                with open(count_file, "w") as stream:
                    stream.write(str(steps.count))
            code = 0
        finally:
            os._exit(code)
    return os.waitpid(pid, 0)[1]


# ====================================================================== what must hold
def _weights(folder) -> dict:
    return C.read_optimizer(folder)["masters"]


def _is(found: dict, state: dict) -> bool:
    return found.keys() == state["masters"].keys() and all(
        torch.equal(found[p], state["masters"][p]) for p in found)


def _check(root, tiny, states: list, step: int) -> None:
    """The invariants after a kill; `states`: what the folder may hold (old, new)."""
    found = C.find_checkpoint(root)
    C.read_trainer(found)  # every file it lists is there, at its written size
    assert any(_is(_weights(found), s) for s in states), found
    for folder in root.glob("checkpoint-*"):
        C.read_checkpoint(folder)  # a visible checkpoint is never half written
    C.recover(root)
    latest = root / (root / C.LATEST).read_text().strip()
    assert any(_is(_weights(latest), s) for s in states)
    _save(root, tiny, states[-1], step)  # the next run's save succeeds
    names = sorted(p.name for p in root.iterdir())
    assert all(n == C.LATEST or n.startswith("checkpoint-") for n in names), names
    assert _is(_weights(C.find_checkpoint(root)), states[-1])


def _kill_everywhere(tmp_path, tiny, earlier_step: int, step: int):
    _, shapes = tiny
    old, new = _state(shapes, 1), _state(shapes, 2)
    base = tmp_path / "base"
    _save(base, tiny, old, earlier_step)
    count = tmp_path / "count"
    root = tmp_path / "counted"
    shutil.copytree(base, root)
    assert _in_child(lambda: _save(root, tiny, new, step), 0, count) == 0
    total = int(count.read_text())
    assert total >= 10  # renames, fsyncs, chmods, folder steps, two files written
    for kill_at in range(1, total + 1):
        root = tmp_path / f"kill{kill_at}"
        shutil.copytree(base, root)
        status = _in_child(lambda: _save(root, tiny, new, step), kill_at)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        _check(root, tiny, [old, new], step)
    return total


def test_kill_at_every_step_of_a_new_save(tmp_path, tiny):
    assert _kill_everywhere(tmp_path, tiny, earlier_step=1, step=2) > 0


def test_kill_at_every_step_of_a_resave_of_the_same_step(tmp_path, tiny):
    assert _kill_everywhere(tmp_path, tiny, earlier_step=2, step=2) > 0


def test_kill_from_outside_at_random_moments(tmp_path, tiny):
    """SIGKILL from the parent after a seeded random delay, while the child re-saves the
    same step over and over (each kill lands wherever the save happens to be)."""
    _, shapes = tiny
    states = [_state(shapes, seed) for seed in (1, 2)]
    rng = random.Random(16)
    for trial in range(6):
        root = tmp_path / f"trial{trial}"
        _save(root, tiny, states[0], 3)

        def forever():
            while True:
                _save(root, tiny, states[1], 3)
                _save(root, tiny, states[0], 3)

        pid = os.fork()
        if pid == 0:
            try:
                forever()
            finally:
                os._exit(1)
        time.sleep(rng.uniform(0.005, 0.08))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        _check(root, tiny, states, 3)
