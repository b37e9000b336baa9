"""Work run in each process of the tensor-parallel tests (torch.multiprocessing starts
them: the functions must be importable). Each process joins a gloo group of `world`
ranks on a free localhost port given by the test and runs its rank's program."""

from __future__ import annotations

import os

import torch

from tests.runtime_models import TINY, token_inputs


def tiny_model(name: str, tensor_parallel: int = 1, rank: int = 0,
               sequence_parallel: bool = False):
    """The tiny model `name` (float64); under tensor parallel, this rank's slices of the
    same random parameters the unsharded model gets (`sequence_parallel`: with `--sp`)."""
    from runtime.hf_weights.schema import tied_targets
    from runtime.model import Model
    from runtime.tensor_parallel import shard_params

    path, settings = TINY[name]
    settings = {k: str(v) for k, v in settings.items()}
    whole = Model.from_module(path, settings=settings, dtype=torch.float64).init_random(seed=0)
    ties = tied_targets(whole.source.program(planned=False).weight_schema)
    whole.params.update({p: whole.params[t] for p, t in ties.items()})  # one tensor
    if tensor_parallel == 1:
        return whole
    model = Model.from_module(path, settings=settings, dtype=torch.float64,
                              tensor_parallel=tensor_parallel, tp_rank=rank,
                              sequence_parallel=sequence_parallel)
    model.params = shard_params(whole.params, model.source.program(planned=False), rank)
    return model


def step(model) -> dict:
    """Forward, a cross-entropy loss (plus the MoE aux loss) and the backward; logits split
    over the vocabulary (`@shard(vocab)` head) get the vocab-parallel loss."""
    from runtime.kernels.vocab_parallel import mean_cross_entropy
    from runtime.tensor_parallel import vocab_outputs

    inputs = token_inputs(model, batch=2, seq=6)
    outputs = model.forward(**inputs)
    targets = torch.roll(inputs["token_ids"].long(), -1, dims=1)
    if "logits" in vocab_outputs(model.source.program(planned=False)):  # a rank's slice
        loss, d_logits = mean_cross_entropy(outputs["logits"], targets,
                                            model.source.tensor_parallel)
    else:
        logits = outputs["logits"].detach().requires_grad_(True)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 targets.reshape(-1))
        (d_logits,) = torch.autograd.grad(loss, logits)
    seeds = {"logits": d_logits}
    if "aux_loss" in outputs:
        loss = loss + outputs["aux_loss"]
        seeds["aux_loss"] = torch.ones_like(outputs["aux_loss"])
    grads = model.backward(**seeds)
    return {"logits": outputs["logits"], "loss": loss.detach(), "grads": grads.params}


def run_cases(rank: int, world: int, port: int, cases: list, out: str) -> None:
    """Each of `cases` on rank `rank` of one gloo group (one spawn serves all of
    tests/test_tensor_parallel.py: starting the processes was most of each case's time),
    saved to `out`.<rank> as {case: result}. A case is ("step", name, own_group): the
    model's step, with `own_group` on a group made for the collectives (as a DP x TP run
    gives each TP slice its own), else on the default group; ("train", name): its AdamW
    steps; ("vocab",): the vocab-parallel kernels (vocab_kernels)."""
    import torch.distributed as dist

    os.environ["NCCL_NVLS_ENABLE"] = "0"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        torch.save({case: _case(case, rank, world) for case in cases}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def _case(case: tuple, rank: int, world: int) -> dict:
    import torch.distributed as dist

    from runtime.kernels.comm import set_tp_group

    kind, *args = case
    if kind == "vocab":
        return vocab_kernels(rank, world)
    if kind == "train":
        return train(tiny_model(args[0], world, rank))
    name, own_group = args
    try:
        if own_group:
            set_tp_group(dist.new_group(list(range(world))))
        return step(tiny_model(name, world, rank))
    finally:
        set_tp_group(None)


def run_rank_sp(rank: int, world: int, port: int, runs: list, out: str) -> None:
    """Rank `rank`'s step of each (model name, `--sp` or not) of `runs`, saved to
    `out`.<rank> as {(name, sp): step}."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        result = {(name, sp): step(tiny_model(name, world, rank, sequence_parallel=sp))
                  for name, sp in runs}
        torch.save(result, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def vocab_kernels(rank: int, world: int) -> dict:
    """The vocab-parallel loss (labels partly ignored) and the lookup's gradient (a padding
    row) on rank `rank`'s block of the same random logits / table (in a gloo group of
    `world` ranks)."""
    from runtime.kernels import KERNELS
    from runtime.kernels.vocab_parallel import _reduce, mean_cross_entropy

    mine = torch.tensor([rank, -rank], dtype=torch.float64)  # the loss's two reductions
    reduced = [_reduce(mine.clone(), world, "tp", op) for op in ("max", "sum")]
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 5, 8, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 8, (3, 5), generator=g)
    labels[0, :3] = -1  # ignore_index
    ids = torch.randint(0, 8, (2, 7), generator=g, dtype=torch.int32)
    d_y = torch.randn(2, 7, 4, generator=g, dtype=torch.float64)
    block = slice(rank * 4, (rank + 1) * 4)
    loss, d_logits = mean_cross_entropy(logits[..., block], labels, world,
                                        ignore_index=-1, chunk_rows=4)  # 4 chunks
    attrs = {"size": world, "padding_idx": 5, "input_shapes": {"weight": (4, 4)}}
    (d_table,) = KERNELS["vocab_parallel_embedding"].backward_fn(d_y, ids, **attrs)
    table = torch.randn(8, 4, generator=g, dtype=torch.float64)
    (part,) = KERNELS["vocab_parallel_embedding"].forward_fn(ids, table[block], size=world)
    # the GPU step's kernel (uncast gather; the backward through the embedding's
    # scatter-add kernel, here its reference) on the same inputs
    from runtime.cuda.train_kernels import train_kernels

    step_kernel = train_kernels("cpu")["vocab_parallel_embedding"]
    (step_d_table,) = step_kernel.backward([d_y, ids], dict(attrs))
    (step_part,) = step_kernel.forward([ids, table[block]], {"size": world})
    return {"loss": loss, "d_logits": d_logits, "d_table": d_table, "part": part,
            "step_d_table": step_d_table, "step_part": step_part, "reduced": reduced}


def windows(steps: int, rows: int, seq: int, vocab: int = 64) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (rows, seq + 1), generator=generator)
            for _ in range(steps)]


def train(model, steps: int = 2, rows: int = 2, seq: int = 6) -> dict:
    """`steps` AdamW steps of the CPU trainer: the losses, then the masters and moments."""
    from runtime.train.backends import CPUTrainer
    from runtime.train.optim import AdamW

    trainer = CPUTrainer(model, rows, seq, AdamW(lr=1e-2, weight_decay=0.1))
    losses = [trainer.train_step(w) for w in windows(steps, rows, seq)]
    state = trainer.state()
    return {"losses": losses, **{k: dict(state[k]) for k in ("masters", "exp_avg",
                                                             "exp_avg_sq")}}


def train_clipped(rank: int, world: int, port: int, runs: list, out: str) -> None:
    """`clipped_runs` in a gloo group of `world` ranks; rank r saves them to `out`.r."""
    from tests.dist_workers import join

    context = join(rank, world, port)
    torch.save(clipped_runs(context, rank, world, runs), f"{out}.{rank}")
    context.close()


def clipped_runs(context, rank: int, world: int, runs: list) -> list[dict]:
    """Each of `runs` ((zero, clip, steps, rows, seq)) on the tiny Llama (float64) with
    --tp 2 over `world` ranks (4: DP 2 x TP 2, each slice its rows): zero None is the CPU
    trainer on one TP pair, else CPUDataParallelTrainer with that ZeRO stage (on one TP
    pair, a section for one data-parallel rank). Per run: its losses, grad norms and the
    whole state (the slices joined)."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from modulec.plan.distributed import DataParallel
    from runtime.dist.context import DataParallelRun
    from runtime.train.backends import CPUTrainer
    from runtime.train.data_parallel import CPUDataParallelTrainer, whole_state
    from runtime.train.optim import AdamW
    from tests.dist_workers import windows as batches

    class OneRank(DataParallelRun):
        def options(self):  # a section for one data-parallel rank (the CLI builds none)
            return DataParallel(1, self.zero)

    alone = [dist.new_group([r]) for r in range(world)]  # one-rank DP groups (world 2)
    results = []
    for zero, clip, steps, rows, seq in runs:
        parallel = context.data_parallel(zero or 0, tp=2)
        if parallel.dp == 1 and zero is not None:
            parallel = OneRank(context, zero, 2, None, alone[rank], 0)
        model = tiny_model("llama", 2, rank % 2)
        model.check_finite = False
        adamw = AdamW(lr=1e-2, weight_decay=0.1, clip_grad=clip)
        own = rows // parallel.dp
        if zero is None:
            parallel.use_tensor_parallel_group()
            trainer = CPUTrainer(model, own, seq, adamw)
        else:
            trainer = CPUDataParallelTrainer(model, own, seq, adamw, parallel)
        part = parallel.dp_rank * own
        losses, norms = [], []
        for window in batches(steps, rows, seq):
            losses.append(trainer.train_step(window[part:part + own]))
            norms.append(trainer.step_metrics()["grad_norm"])
        whole = whole_state(trainer.state(), model,
                            SimpleNamespace(tp=2, tp_group=parallel.tp_group))
        results.append({"losses": losses, "norms": norms, "whole": whole})
    return results


def step_interpreter_rank(rank: int, world: int, port: int, out: str) -> None:
    """Rank `rank`'s step of the tiny Llama (the tp_overlap program) by the reference
    interpreter and by the GPU step's interpreter issuing each async collective through
    runtime.cuda.async_comm.InFlight (on InOrder, the CPU's streams), saved to
    `out`.<rank> with the ops each backward issued and left unjoined."""
    import torch.distributed as dist

    from runtime.cuda.async_comm import InFlight
    from runtime.cuda.step_interpreter import _StepInterpreter
    from runtime.dist.streams import InOrder

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        model = tiny_model("llama", world, rank)
        want = step(model)
        flights = []

        def interpreter():
            run = _StepInterpreter(model.program.graph, model.params, model.dtype,
                                   check_finite=False)
            run.in_flight = InFlight(InOrder())
            flights.append(run.in_flight)
            return run
        model._interpreter = interpreter
        got = step(model)
        waits = sum(n.kind == "wait" for f in model.program.graph.functions for n in f.nodes)
        torch.save({"want": want, "got": got, "issued": [f.issued for f in flights],
                    "held": [len(f.held) for f in flights], "waits": waits},
                   f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def packed_train(model, steps: int, rows: int, seq: int, accumulation: int) -> dict:
    """`steps` packed AdamW steps (--doc-sep, runtime.train.packing) of the CPU trainer on
    the windows of tests/dist_workers.packed_windows, then the evaluation's packed loss
    (runtime.train.evaluate.cpu_loss) of the trained weights on one more window: the
    losses, the eval loss, then the masters and moments."""
    from runtime.train.backends import CPUTrainer
    from runtime.train.evaluate import cpu_loss
    from runtime.train.optim import AdamW
    from runtime.train.packing import Packing
    from tests.dist_workers import SEP, packed_windows

    model.check_finite = False
    trainer = CPUTrainer(model, rows, seq, AdamW(lr=1e-2, weight_decay=0.1), accumulation,
                         Packing(SEP))
    *windows, held_out = packed_windows(steps + 1, rows * accumulation, seq)
    losses = [trainer.train_step(w) for w in windows]
    state = trainer.state()
    return {"losses": losses, "eval": cpu_loss(trainer, held_out[:rows]),
            **{k: dict(state[k]) for k in ("masters", "exp_avg", "exp_avg_sq")}}


def packed_shares(model, rows: int, seq: int, dp: int) -> dict:
    """Packed data parallel's loss on a tensor-parallel group, the `dp` data-parallel
    ranks' rows of one micro-batch run one after the other: each rank's summed loss
    divided by its denominator (runtime.train.packing.denominators), then averaged over
    the ranks as ZeRO averages their gradients (and the trainers their losses): with
    dp = 1 one process's mean loss and gradients on the same rows."""
    from runtime.train.backends import CPUTrainer
    from runtime.train.optim import AdamW
    from runtime.train.packing import Packing, denominators
    from tests.dist_workers import SEP, packed_windows

    model.check_finite = False
    packing = Packing(SEP)
    trainer = CPUTrainer(model, rows // dp, seq, AdamW(), 1, packing)
    window = packed_windows(1, rows, seq)[0]
    (denominator,) = denominators(window, packing, rows // dp, dp)
    loss, grads = 0.0, {}
    for part in window.split(rows // dp):
        share, own = trainer._loss_and_gradients(part, denominator if dp > 1 else None)
        loss = loss + share
        grads = {p: grads[p] + g if p in grads else g for p, g in own.items()}
    return {"loss": loss / dp, "grads": {p: g / dp for p, g in grads.items()}}


def packed_rank(rank: int, world: int, port: int, runs: list, sizes: tuple,
                out: str) -> None:
    """Each of `runs` ((model name, `--sp` or not, shares or not)) packed over a
    tensor-parallel group of `world` gloo ranks (float64, the same rows on every rank):
    `packed_shares` of two data-parallel ranks (where asked), then `packed_train`'s steps;
    saved to `out`.<rank> by (name, sp)."""
    import torch.distributed as dist

    steps, rows, seq, accumulation = sizes
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        result = {}
        for name, sp, shares in runs:
            model = tiny_model(name, world, rank, sequence_parallel=sp)
            got = {"shares": packed_shares(model, 2 * rows, seq, 2)} if shares else {}
            got["train"] = packed_train(model, steps, rows, seq, accumulation)
            result[name, sp] = got
        torch.save(result, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()
