"""The optimizer of `modulec train` on the CPU: learning-rate schedules against their
closed forms and against transformers' and torch's schedulers, global gradient-norm
clipping against torch.nn.utils.clip_grad_norm_ + torch.optim.AdamW, the default
weight-decay exclusions (and `@trainable(wd_scale=)`, `--decay-all`), resume in the
middle of a schedule, and two gloo processes with clipping against one process."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.test_train import LLAMA, TINY_LM, _tensors, ckpt, events, losses, train  # noqa: E402,F401,E501


# ------------------------------------------------------------------ schedules
def _schedule(kind, lr=1.0, steps=20, warmup=4, min_lr=0.0, **more):
    from runtime.train.schedule import schedule_of

    return schedule_of(kind, lr, steps, warmup, min_lr, **more)


def test_schedules_follow_their_closed_forms():
    lr, low, n, w = 3e-3, 3e-4, 20, 4
    for kind in ("constant", "linear", "cosine"):
        s = _schedule(kind, lr, n, w, low if kind != "constant" else 0.0)
        for t in range(1, n + 1):
            p = (t - w) / (n - w)
            want = lr * t / w if t <= w else {
                "constant": lr,
                "linear": low + (lr - low) * (1 - p),
                "cosine": low + (lr - low) * 0.5 * (1 + math.cos(math.pi * p))}[kind]
            assert s.lr_at(t) == pytest.approx(want, rel=1e-12, abs=1e-15), (kind, t)
        assert s.lr_at(w) == lr and (kind == "constant" or s.lr_at(n) == pytest.approx(low))
    wsd = _schedule("wsd", lr, n, w, low, decay_steps=5, decay_shape="1-sqrt")
    assert [wsd.lr_at(t) for t in range(w, 16)] == [lr] * (16 - w)
    for t in range(16, n + 1):
        q = (t - 15) / 5
        assert wsd.lr_at(t) == pytest.approx(low + (lr - low) * (1 - math.sqrt(q)))
    assert _schedule("wsd", steps=100, warmup=0).decay_steps == 10  # --decay-fraction 0.1
    assert _schedule("wsd", steps=30, warmup=0, decay_fraction=0.25).decay_steps == 8


def test_schedules_equal_transformers_and_torch():
    """Step t takes transformers' lambda at t (its Trainer's step t takes it at t - 1)."""
    from transformers import optimization as hf

    n, w = 30, 5
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    cases = [
        (_schedule("linear", steps=n, warmup=w),
         hf.get_linear_schedule_with_warmup(opt, w, n)),
        (_schedule("cosine", steps=n, warmup=w, min_lr=0.1),
         hf.get_cosine_with_min_lr_schedule_with_warmup(opt, w, n, min_lr_rate=0.1)),
        (_schedule("wsd", steps=n, warmup=w, decay_steps=8, decay_shape="cosine"),
         hf.get_wsd_schedule(opt, w, 8, num_training_steps=n, decay_type="cosine")),
        (_schedule("wsd", steps=n, warmup=0, min_lr=0.2, decay_steps=8),
         hf.get_wsd_schedule(opt, 0, 8, num_training_steps=n, decay_type="linear",
                             min_lr_ratio=0.2)),
    ]
    for ours, theirs in cases:
        for t in range(1, n + 1):
            assert ours.lr_at(t) == pytest.approx(theirs.lr_lambdas[0](t), abs=1e-12), \
                (ours.kind, t)
    # no warmup: torch's CosineAnnealingLR after t of its steps
    base = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=2.0)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(base, T_max=n, eta_min=0.5)
    ours = _schedule("cosine", lr=2.0, steps=n, warmup=0, min_lr=0.5)
    for t in range(1, n + 1):
        base.step()
        cosine.step()
        assert ours.lr_at(t) == pytest.approx(base.param_groups[0]["lr"], rel=1e-12)


@pytest.mark.parametrize("args, message", [
    (["--warmup", "9"], "--warmup 9 must be between 0 and --steps 4"),
    (["--lr-schedule", "cosine", "--min-lr", "1"], "--min-lr 1.0 must be between 0"),
    (["--min-lr", "1e-3"], "--lr-schedule constant has none"),
    (["--decay-steps", "2"], "are for --lr-schedule wsd"),
    (["--lr-schedule", "cosine", "--decay-shape", "cosine"], "are for --lr-schedule wsd"),
    (["--lr-schedule", "wsd", "--warmup", "2", "--decay-steps", "3"], "does not fit"),
    (["--clip-grad", "0"], "--clip-grad is 0.0: it must be a finite number > 0"),
    (["--beta2", "1"], "--beta2 is 1.0: it must be in [0, 1)"),
    (["--eps", "-1"], "--eps is -1.0"),
])
def test_optimizer_mistakes_are_one_clear_error(ckpt, args, message):
    result = train(ckpt, "--steps", "4", *args)
    assert result.exit_code == 1, result.output
    assert message in result.output and "Traceback" not in result.output


# ------------------------------------------------------------------ clipping, decay
def _tiny(tmp_path, notes=None, name="tiny"):
    from runtime.model import Model

    notes = notes or {}
    path = tmp_path / f"{name}.module"
    path.write_text(TINY_LM.format(**{k: notes.get(k, "")
                                      for k in ("embedding", "norm", "proj", "lm_head")}))
    return Model.from_module(path, dtype=torch.float32).init_random(0, std=0.5)


def _windows(steps):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 16, (2, 7), generator=g) for _ in range(steps)]


def test_clipping_and_exclusions_equal_torch(tmp_path):
    """CPUTrainer with --clip-grad, weight decay and its default exclusions (the norm and
    the embedding) against torch: the same gradients clipped by clip_grad_norm_, then
    torch.optim.AdamW with a decay group and a no-decay group, with a schedule's rates."""
    from runtime.train.backends import CPUTrainer
    from runtime.train.optim import AdamW

    model, ref_model = _tiny(tmp_path), _tiny(tmp_path, name="ref")
    schedule = _schedule("cosine", lr=1e-2, steps=4, warmup=1, min_lr=1e-3)
    trainer = CPUTrainer(model, 2, 6, AdamW(lr=1e-2, weight_decay=0.1, clip_grad=0.05))
    grads_of = CPUTrainer(ref_model, 2, 6, AdamW())  # its loss and gradients only
    params = {p: ref_model.params[p] for p in trainer.names}
    groups = [{"params": [params["embedding"], params["norm"]], "weight_decay": 0.0},
              {"params": [params["proj"], params["lm_head"]], "weight_decay": 0.1}]
    reference = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8,
                                  foreach=False)
    for t, window in enumerate(_windows(4), start=1):
        trainer.set_lr(schedule.lr_at(t))
        trainer.train_step(window)
        _, grads = grads_of._loss_and_gradients(window)
        for path, p in params.items():
            p.grad = grads[path].clone()
        norm = torch.nn.utils.clip_grad_norm_(list(params.values()), 0.05)
        assert float(norm) > 0.05  # clipping is active
        assert trainer.step_metrics()["grad_norm"] == float(norm)
        for group in reference.param_groups:
            group["lr"] = schedule.lr_at(t)
        reference.step()
        for path, p in params.items():
            assert torch.allclose(model.params[path], p, rtol=1e-6, atol=1e-7), (t, path)


def test_decay_exclusions_and_their_overrides(tmp_path):
    from runtime.program import ModuleSource
    from runtime.train.optim import AdamW
    from runtime.train.param_groups import hyperparameters, no_decay

    source = ModuleSource(Path(LLAMA), {
        "vocab_size": "64", "d_model": "32", "n_layers": "2", "num_heads": "4",
        "num_kv_heads": "2", "d_ff": "48", "max_seq": "64"})
    excluded = no_decay(source.program(planned=False))
    assert excluded == {"embedding", "final_norm.weight", "blocks[0].ln1.weight",
                        "blocks[0].ln2.weight", "blocks[1].ln1.weight",
                        "blocks[1].ln2.weight"}
    model = _tiny(tmp_path, {"norm": "@trainable(wd_scale=1.0)",
                             "proj": "@trainable(wd_scale=0.5)"}, name="over")
    program = model.source.program(planned=False)
    assert no_decay(program) == {"embedding", "norm"}
    base = AdamW(lr=1.0, weight_decay=0.1)
    decays = {p: hyperparameters(program, p, base)[1] for p in model.params}
    # a written wd_scale wins over the default exclusion (1.0 included)
    assert decays == {"embedding": 0.0, "norm": 0.1, "proj": 0.05, "lm_head": 0.1}
    everything = AdamW(lr=1.0, weight_decay=0.1, decay_all=True)
    assert hyperparameters(program, "embedding", everything)[1] == 0.1


def test_decay_all_on_the_command_line(ckpt, tmp_path):
    """One step with --weight-decay 0.5: by default the norms and the embedding are not
    decayed; --decay-all takes lr x wd x (their start) off them too (the final norm
    starts at 1: 0.05 less), and matrices are decayed either way (the same values)."""
    args = ("--steps", "1", "--weight-decay", "0.5", "--lr", "0.1")
    assert train(ckpt, *args, "--save", tmp_path / "ex").exit_code == 0
    assert train(ckpt, *args, "--decay-all", "--save", tmp_path / "all").exit_code == 0
    ex, every = (_tensors(tmp_path / f / "checkpoint-1") for f in ("ex", "all"))
    norm = "opt.master.final_norm.weight"
    assert torch.allclose(ex[norm] - every[norm], torch.full_like(ex[norm], 0.05),
                          atol=1e-6)
    assert not torch.equal(ex["opt.master.embedding"], every["opt.master.embedding"])
    matrix = "opt.master.blocks[0].mlp.down_weight"
    assert torch.equal(ex[matrix], every[matrix])
    state = json.loads((tmp_path / "all" / "checkpoint-1" / "trainer_state.json").read_text())
    assert state["adamw"]["decay_all"] is True and state["schedule"]["kind"] == "constant"


# ------------------------------------------------------------------ resume
SCHEDULED = ("--lr-schedule", "cosine", "--warmup", "2", "--min-lr", "1e-3",
             "--clip-grad", "0.5", "--weight-decay", "0.1")


def test_resume_mid_schedule_continues_the_curve(ckpt, tmp_path):
    whole = train(ckpt, "--steps", "7", *SCHEDULED, "--save", tmp_path / "a")
    first = train(ckpt, "--steps", "7", *SCHEDULED, "--save", tmp_path / "b",
                  "--save-every", "3")
    assert losses(first) == losses(whole)
    rest = train(ckpt, "--steps", "7", *SCHEDULED, "--resume", tmp_path / "b" /
                 "checkpoint-3", "--save", tmp_path / "c", weights=False)
    steps = events(whole)
    assert [r["loss"] for r in events(rest)] == [r["loss"] for r in steps[3:]]
    assert [r["lr"] for r in events(rest)] == [r["lr"] for r in steps[3:]]
    assert [r["grad_norm"] for r in events(rest)] == [r["grad_norm"] for r in steps[3:]]
    a, c = _tensors(tmp_path / "a" / "checkpoint-7"), _tensors(tmp_path / "c" / "checkpoint-7")
    assert a.keys() == c.keys() and all(torch.equal(a[k], c[k]) for k in a)
    lrs = [r["lr"] for r in steps]
    assert lrs[:2] == [5e-3, 1e-2] and lrs[-1] == pytest.approx(1e-3)
    # another curve over the steps taken is refused, naming the step that differs
    other = train(ckpt, "--steps", "9", *SCHEDULED, "--resume", tmp_path / "b" /
                  "checkpoint-3", weights=False)
    assert other.exit_code == 1 and "gives step 3 another rate" in other.output


def test_which_schedules_a_resume_may_change():
    """The steps taken keep their rates: a constant schedule may take a new --lr (same
    warmup), a WSD run in its stable phase more --steps; a new warmup, or a cosine over
    other --steps, is refused; a checkpoint from before schedules ran a constant rate."""
    from runtime.errors import RuntimeUserError
    from runtime.train.optim_options import check_resume_schedule

    def saved(step, **options):
        return {"step": step, "schedule": _schedule(**options).as_json()}

    allowed = [(saved(5, kind="constant", lr=1.0, warmup=2), _schedule("constant", lr=0.5,
                                                                       warmup=2)),
               (saved(5, kind="wsd", steps=20, decay_steps=4), _schedule("wsd", steps=30,
                                                                        decay_steps=4)),
               ({"step": 5, "adamw": {"lr": 1.0}}, _schedule("constant", lr=0.1, warmup=0))]
    for trainer, schedule in allowed:
        check_resume_schedule(trainer, schedule, "ckpt")
    refused = [(saved(5, kind="constant", warmup=2), _schedule("constant", warmup=0), 1),
               (saved(8, kind="cosine", steps=20), _schedule("cosine", steps=30), 5),
               (saved(18, kind="wsd", steps=20, decay_steps=4),
                _schedule("wsd", steps=30, decay_steps=4), 17),
               ({"step": 5, "adamw": {"lr": 1.0}}, _schedule("cosine", warmup=0), 1)]
    for trainer, schedule, step in refused:
        with pytest.raises(RuntimeUserError, match=f"gives step {step} another rate"):
            check_resume_schedule(trainer, schedule, "ckpt")


def test_wsd_in_its_stable_phase_may_be_extended(ckpt, tmp_path):
    wsd = ("--lr-schedule", "wsd", "--warmup", "1", "--decay-steps", "2")
    train(ckpt, "--steps", "6", *wsd, "--save", tmp_path / "w", "--save-every", "3")
    longer = train(ckpt, "--steps", "8", *wsd, "--resume", tmp_path / "w" / "checkpoint-3",
                   weights=False)
    assert [r["lr"] for r in events(longer)] == [1e-2, 1e-2, 1e-2, 5e-3, 0.0]


# ------------------------------------------------------------------ data parallel
def _two_processes(ckpt, *args) -> list[dict]:
    """`torchrun --nproc-per-node 2 -m modulec train` (gloo, one row each): rank 0's
    step records."""
    from tests.dist_testing import free_port

    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-port", str(free_port()), "-m", "modulec", "train", LLAMA,
               "--data", str(ckpt / "tokens.bin"), "--seq", "16", "--batch", "1",
               "--device", "cpu", "--lr", "1e-2", "--format", "json",
               "--hf-weights", str(ckpt / "hf"), *map(str, args)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return [r for r in rows if r["event"] == "step"]


def test_two_processes_clip_as_one(ckpt, tmp_path):
    """ZeRO-3 on two gloo processes: the norm is the all_reduce of the shards' squares,
    the updates wait for it; losses, norms and weights as one process's."""
    clipped = (*SCHEDULED, "--clip-grad", "0.2")
    one = train(ckpt, "--steps", "3", *clipped, "--save", tmp_path / "one")
    two = _two_processes(ckpt, "--steps", "3", "--zero", "3", *clipped,
                         "--save", tmp_path / "two")
    want = events(one)
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in want], rel=1e-5)
    assert [r["grad_norm"] for r in two] == pytest.approx([r["grad_norm"] for r in want],
                                                          rel=1e-4)
    assert all(r["grad_norm"] > 0.2 for r in want)  # clipped at every step
    from safetensors.torch import load_file

    a, b = (load_file(str(tmp_path / run / "checkpoint-3" / "model.safetensors"))
            for run in ("one", "two"))
    assert a.keys() == b.keys()
    # fp32 sums in another order (two processes' all_reduce): near-zero elements differ by
    # rounding on the tensor's scale (1.6e-6 of lm_head's 0.088 seen), not by their own
    for k in a:
        scale = float(a[k].abs().max())
        assert torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-4 * scale), \
            (k, float((a[k] - b[k]).abs().max()), scale)


def test_every_zero_stage_defers_its_updates_for_clipping():
    """ZeRO 0, 1, 2 (3: the two-process test above) in this process on a world-1 gloo
    group: the reduced gradient parts held, the norm, then the deferred updates and
    gathers, with the decay exclusions run per segment, equal CPUTrainer in float64."""
    import torch.distributed as dist

    from modulec.plan.distributed import DataParallel
    from runtime.dist.context import DataParallelRun, DistContext
    from runtime.train.backends import CPUTrainer
    from runtime.train.data_parallel import CPUDataParallelTrainer
    from runtime.train.optim import AdamW
    from tests.dist_workers import tiny_model, windows
    from tests.dist_testing import free_port

    class OneRank(DataParallelRun):
        def options(self):  # a section for one rank (the CLI runs none)
            return DataParallel(1, self.zero)

    def adamw():
        return AdamW(lr=1e-2, weight_decay=0.1, clip_grad=0.05)

    reference = CPUTrainer(tiny_model("llama"), 2, 8, adamw())
    want = [reference.train_step(w) for w in windows(2, 2, 8)]
    assert float(reference.grad_norm) > 0.05
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        context = DistContext(0, 1, 0, "cpu", "gloo")
        for zero in (0, 1, 2):
            trainer = CPUDataParallelTrainer(tiny_model("llama"), 2, 8, adamw(),
                                             OneRank(context, zero))
            assert [trainer.train_step(w) for w in windows(2, 2, 8)] == want
            assert float(trainer.zero.grad_norm) == pytest.approx(
                float(reference.grad_norm), rel=1e-12)
            got, ref = trainer.state(), reference.state()
            for part in ("masters", "exp_avg", "exp_avg_sq"):
                for path, value in ref[part].items():
                    assert torch.allclose(got[part][path], value, rtol=1e-12,
                                          atol=1e-15), (zero, part, path)
    finally:
        dist.destroy_process_group()


def test_the_gradients_clipping_holds_count_in_the_step_state():
    """The budget planner's offset counts what global clipping holds: every bf16 gradient
    on one GPU, and under ZeRO each rank's reduced part per bucket instance, which is
    what ZeroRun allocates."""
    from modulec.plan.distributed import DataParallel
    from runtime.cuda.step import runtime_fixed_bytes
    from runtime.cuda.step_optim import clipped_held_bytes
    from runtime.dist.streams import InOrder
    from runtime.dist.zero import Precision, ZeroRun
    from runtime.inputs import sized_inputs
    from runtime.model import parameter_shapes
    from runtime.program import ModuleSource

    settings = {"vocab_size": "64", "d_model": "32", "n_layers": "2", "num_heads": "4",
                "num_kv_heads": "2", "d_ff": "48", "max_seq": "64"}
    program = ModuleSource(Path(LLAMA), settings).program(planned=False)
    trained = sum(math.prod(s) for s in parameter_shapes(program.graph).values())
    assert runtime_fixed_bytes(program, clipped=True) - runtime_fixed_bytes(program) == \
        2 * trained
    for zero in (2,):
        source = ModuleSource(Path(LLAMA), settings, distributed=DataParallel(2, zero))
        sharded = source.program_for(sized_inputs(["token_ids"], 1, 16))
        section = sharded.document["schedule"]["distributed"]
        run = ZeroRun(section, 0, Precision(torch.float32, torch.bfloat16, split=False,
                                            update=None), "cpu", InOrder(), clip=1.0)
        run.load({p: torch.zeros(s) for p, s in parameter_shapes(sharded.graph).items()})
        held = sum(t.numel() * t.element_size() for b in run.buckets for t in b.held)
        assert held == clipped_held_bytes(section) > 0
        assert runtime_fixed_bytes(sharded, clipped=True) - runtime_fixed_bytes(sharded) == held
