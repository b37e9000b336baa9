"""modulec's data-parallel step on this host's GPUs, one ZeRO stage per launch (run under
torchrun; rank 0 prints one JSON line), or with `--tp 2` tensor parallel (`--check`: rank 0
then trains the same weights on one GPU and prints both losses): TinyLlama shape by
default, B per data-parallel rank, T, random
weights and tokens, the whole step captured in one CUDA graph; median step time of
`--steps` replays (all ranks synchronized), tokens/s over all ranks, per-GPU peak, and the
fixed state this rank holds (weights, masters, moments, communication buffers).

    torchrun --nproc-per-node 2 benchmarks/gpu/dist_probe.py --zero 2 [--layers 22]
    torchrun --nproc-per-node 2 benchmarks/gpu/dist_probe.py --zero 2 --ab MODULEC_GEMM_TUNE
    python3 benchmarks/gpu/dist_probe.py --zero 0       # one GPU, no process group
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.harness import alternated, ms_summary  # noqa: E402
from benchmarks.train_step import flops_per_token, tiny_llama  # noqa: E402

LLAMA3_8B = dict(vocab_size=128256, d_model=4096, n_layers=32, num_heads=32, num_kv_heads=8,
                 d_ff=14336, max_seq=8192, eps=1e-5, rope_theta=500000.0)


def main() -> None:
    args = _args()
    from runtime.cuda.step import TrainStep
    from runtime.dist import DistContext

    ctx = DistContext.from_env(device="cuda")
    shape = LLAMA3_8B if args.shape == "llama3-8b" else tiny_llama(22)
    if args.layers:
        shape = dict(shape, n_layers=args.layers)
    run = ctx.data_parallel(args.zero, tp=args.tp) if ctx.distributed else None
    budget = int(args.budget * 2 ** 30) if args.budget else None
    build = dict(batch=args.batch, seq=args.seq, derive_written=True, memory_budget=budget)
    if args.ab:
        return _ab(ctx, args, shape, build, run)
    step = TrainStep.from_module(LLAMA, shape, dist=run, **build)
    params, whole = _weights(step, shape, build, args, run)
    step.load(params)
    torch.cuda.empty_cache()
    # one batch per data-parallel rank (a TP slice's ranks read the same rows)
    tokens = _tokens(args, shape, run)
    losses, times = _train(ctx, step, tokens, args.steps)
    _report(ctx, args, shape, step, times, losses)
    if args.gaps:
        _gaps(ctx, step, args.gaps)
    _sync(ctx)
    if args.tp > 1 and args.check and ctx.is_main:  # the same model on this one GPU
        del step
        torch.cuda.empty_cache()
        one = TrainStep.from_module(LLAMA, shape, **build)
        one.load(whole)
        reference, _ = _train(None, one, tokens, args.steps)
        print(json.dumps({"tp_check": True, "tp_losses": losses,
                          "one_gpu_losses": reference,
                          "max_rel": max(abs(a - b) / abs(b)
                                         for a, b in zip(losses, reference))}), flush=True)
    ctx.close()
    ctx.exit_now()


LLAMA = "std/models/llama.module"


def _tokens(args, shape, run):
    generator = torch.Generator(device="cuda").manual_seed(
        100 + (run.dp_rank if run is not None else 0))
    return torch.randint(0, shape["vocab_size"], (args.batch, args.seq), device="cuda",
                         generator=generator, dtype=torch.int32)


def _ab(ctx, args, shape, build, run) -> None:
    """`--ab NAME`: the step built, loaded with the same weights and captured twice, the
    environment switch NAME at 0 and at 1 (read while the step runs eagerly and is
    captured), then the two graphs replayed alternately, `--steps` each, every replay
    timed between syncs of all ranks; rank 0 prints each side's median, min, max and
    last loss (both sides take the same batches: their losses should agree)."""
    from runtime.cuda.step import TrainStep

    tokens, steps = _tokens(args, shape, run), {}
    for value in args.ab_values.split(","):
        os.environ[args.ab] = value
        step = TrainStep.from_module(LLAMA, shape, dist=run, **build)
        step.load(_weights(step, shape, build, args, run)[0])
        step(tokens)
        step.capture(warmup=1)
        steps[value] = step
    def all_ranks_ms(replay) -> float:
        _sync(ctx)
        began = time.perf_counter()
        replay()
        _sync(ctx)
        return (time.perf_counter() - began) * 1e3

    times = alternated({v: s.cuda_graph.replay for v, s in steps.items()}, args.steps,
                       all_ranks_ms)
    row = {"ab": args.ab, "gpus": ctx.world, "zero": args.zero, "layers": shape["n_layers"],
           "device": torch.cuda.get_device_name()}
    for value, summary in ms_summary(times).items():
        row[value] = dict(summary, loss=float(steps[value].loss))
    if ctx.is_main:
        print(json.dumps(row), flush=True)
    _sync(ctx)
    ctx.close()
    ctx.exit_now()


def _weights(step, shape, build, args, run) -> tuple[dict, dict | None]:
    """(this rank's random weights, the whole model's or None): with tensor parallel,
    drawn for the whole model on the host and each rank's slices taken, so that one GPU
    can run the same model (`--check`)."""
    from runtime.cuda.step import TrainStep, random_params

    on = "cpu" if args.shape == "llama3-8b" or args.tp > 1 else "cuda"
    if args.tp == 1:
        return random_params(step.shapes(), 0, on=on), None
    from runtime.tensor_parallel import shard_params

    whole = random_params(TrainStep.from_module(LLAMA, shape, **build).shapes(), 0, on=on)
    return shard_params(whole, step.program, run.context.rank % args.tp), whole


def _train(ctx, step, tokens, steps: int) -> tuple[list, list]:
    """An eager step, the capture (one warm-up step), `steps` timed replays: the losses of
    the first three steps and the replays' times."""
    losses = [float(step(tokens))]
    step.capture(warmup=1)
    losses.append(float(step.loss))
    times = []
    for _ in range(steps):
        _sync(ctx)
        began = time.perf_counter()
        step.cuda_graph.replay()
        _sync(ctx)
        times.append(time.perf_counter() - began)
    losses.append(float(step.loss))
    return losses, times


def _gaps(ctx, step, path: str) -> None:
    """`--gaps FILE`: one replay under the profiler on every rank; rank 0 writes its
    graph nodes (benchmarks/gpu/graph_gaps.py) and prints the summary."""
    sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
    from graph_gaps import profiled_nodes, render, summarize, write_nodes

    _sync(ctx)
    nodes = profiled_nodes(step.cuda_graph.replay, 1)
    if ctx.is_main:
        write_nodes(nodes, path)
        print(render(summarize(nodes, 12)), flush=True)
    _sync(ctx)


def _sync(ctx) -> None:
    torch.cuda.synchronize()
    if ctx is not None and ctx.distributed:
        dist.barrier()


def _report(ctx, args, shape, step, times, losses) -> None:
    seconds = statistics.median(times)
    tokens = args.batch * args.seq * ctx.world // args.tp
    from runtime.dist.ce_gather import peak_allocated, window_bytes

    peak = torch.tensor([peak_allocated()], device="cuda")
    if ctx.distributed:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    fixed = step.zero.fixed_bytes() if step.zero is not None else None
    dp = ctx.world // args.tp
    row = {"gpus": ctx.world, "zero": args.zero if dp > 1 else None, "tp": args.tp,
           "shape": args.shape, "layers": shape["n_layers"], "batch_per_gpu": args.batch,
           "seq": args.seq, "step_ms": seconds * 1e3, "tokens_per_s": tokens / seconds,
           "tokens_per_s_per_gpu": tokens / seconds / ctx.world,
           "peak_gib_per_gpu": float(peak) / 2 ** 30,
           "fixed_gib_per_gpu": fixed / 2 ** 30 if fixed is not None else None,
           "mfu_989": tokens / seconds / ctx.world * flops_per_token(shape, args.seq) / 989e12,
           "loss_first": losses[0], "loss_last": losses[-1],
           "device": torch.cuda.get_device_name(), "budget_gib": args.budget,
           "gather": step.zero.gather_transport if step.zero is not None else None,
           "window_gib": window_bytes() / 2 ** 30, "device_used_gib": _device_used_gib()}
    if ctx.is_main:
        print(json.dumps(row), flush=True)


def _device_used_gib() -> float:
    """What the device has in use (torch's allocator and everything else: NCCL's windows,
    the CUDA context)."""
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2 ** 30


def _args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--zero", type=int, default=2)
    parser.add_argument("--layers", type=int, help="fewer layers than the shape's")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--shape", choices=["tinyllama", "llama3-8b"], default="tinyllama")
    parser.add_argument("--budget", type=float, help="GiB per GPU for the whole step")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--ab", metavar="NAME",
                        help="an environment switch: the step at NAME=0 and NAME=1 in one "
                             "process, replayed alternately")
    parser.add_argument("--ab-values", default="0,1", help="--ab's values, in build order")
    parser.add_argument("--gaps", metavar="FILE",
                        help="rank 0 writes a profiled replay's graph nodes (graph_gaps.py)")
    parser.add_argument("--check", action="store_true",
                        help="with --tp: rank 0 then runs the same weights and batch on one "
                             "GPU and prints both runs' losses")
    return parser.parse_args()


if __name__ == "__main__":
    main()
