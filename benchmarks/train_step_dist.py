"""One data-parallel training step (forward + backward + AdamW, bf16 compute, fp32 master
weights) on the GPUs of one host, side by side in one run (issue 17, item 8):

    modulec_zero1..3  modulec's data parallel (runtime.dist.DistContext.data_parallel),
                 ZeRO stage 1/2/3 (modulec_zero0 on request: replicated state, the
                 reference for the fixed bytes); the step built as train_step.py's
                 `modulec_norecompute` (the derived backward, fused AdamW inside the
                 backward, arena), the whole step with its collectives in one CUDA graph
    modulec_tp2  modulec's tensor parallel over the GPUs: "not available" until
                 runtime.dist.DistContext has `tensor_parallel`; then run as
                 dist=ctx.tensor_parallel(size=GPUS) (adjust to the API when it lands)
    modulec_1gpu train_step.py's `modulec_norecompute` on ONE of the GPUs, in the same
                 run: the denominator of the scaling efficiency
    hf_ddp       transformers LlamaForCausalLM (sdpa), fp32 weights + autocast bf16,
                 DistributedDataParallel (gradient_as_bucket_view), fused AdamW
    hf_fsdp2     the same model under FSDP2: fully_shard on every decoder layer and on the
                 root, MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), fp32
                 sharded parameters, fused AdamW on the shards (no autocast: FSDP casts)
    ..._compile  suffix: torch.compile; DDP compiles the whole model (DDPOptimizer splits
                 the graph at the buckets), FSDP2 each decoder layer before fully_shard
                 (torchtitan's recipe); `_compilewhole` / `_compilelayers` force the other
    ..._ckpt     suffix: activation checkpointing of every decoder layer (the peer of the
                 llama3-8b shape, where nothing else fits)
    ..._fp8      suffix: FP8 matmuls. modulec: the std FP8 recipe (`--precision fp8`,
                 runtime/fp8_gemm.py); HF: torchao's convert_to_float8_training on the
                 decoder's linears before sharding (tensorwise dynamic scaling, the LM head
                 in bf16; torchao must be importable). Each is the other's FP8 peer; the
                 bf16 rows stay the issue's comparison

Every variant runs in its own process group (`torchrun --standalone --nproc-per-node
GPUS`, or one plain process for modulec_1gpu), NCCL_NVLS_ENABLE=0 always, so peak-memory
counters start clean. HF variants start from the HF checkpoint train_step.py writes
(random weights; the llama3-8b shape is initialized on each rank instead, fp32 at 0.02,
so no 32 GB checkpoint is written); modulec's distributed variants from
`init_random(0)`, the same weights on every rank; rank r trains on its own random batch
(generator seed 1 + r: rank 0's is the one-GPU batch).

What is measured, per variant:
  step_ms       median over --steps timed steps after --warmup steps: before each step
                every rank synchronizes its device and meets the others at a barrier; a
                step ends when its device is idle; the step's time is the max over ranks
  step_ms_b2b   train_step.py's timer (CUDA events around back-to-back steps, no host
                sync between them), max over ranks of each rank's median
  tokens/s      B x T x GPUs / step time, and per GPU; MFU per GPU as train_step.py
                (tokens/s per GPU x flops_per_token against 989 TFLOP/s)
  peak          max over ranks of torch.cuda.max_memory_allocated, counted from just
                before the warm-up (weights, optimizer state and everything after)
  scaling       total tokens/s / (GPUS x modulec_1gpu tokens/s), when modulec_1gpu runs
  comm / exposed  from torch.profiler over --profile-steps steps after the timing: the
                GPU time covered by NCCL kernels (union of their intervals) and the part
                of it during which no other kernel, memcpy or memset runs on that GPU:
                communication the step waits on rather than hides. An NCCL kernel also
                spins while it waits for a slower rank, so imbalance counts as exposed.
                Per step, max over ranks; absent on the CPU (no device kernels). What
                overlapped communication costs the kernels it runs beside (SMs, memory
                bandwidth) is not in it: that shows in step_ms only
  +ms/1GPU      modulec data parallel: its step time less modulec_1gpu's (each rank runs
                one GPU's step on its own batch): what data parallel costs a step, exposed
                communication, rank imbalance and overlap contention together
  fixed         modulec under ZeRO: the fixed state a rank holds (step.zero.fixed_bytes)
  loss          the last timed step's loss, mean over ranks (each rank's own batch)

--device cpu runs the HF peers on gloo CPU processes at --shape tiny: a check of their
code paths (tests/test_dist_bench.py), not a measurement. --budget GiB builds modulec's
steps with the budget planner (TrainStep.from_module(memory_budget=...)), as for the
llama3-8b shape (B=1, whose peer is FSDP2 + activation checkpointing).

    python benchmarks/train_step_dist.py [--variants modulec_zero2,hf_fsdp2_compile,...]
        [--steps 10] [--layers 22] [--batch 4] [--seq 2048] [--json out.json]
        [--shape tinyllama|llama3-8b] [--gpus 2] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.train_step import (PEAK, flops_per_token, hf_config,  # noqa: E402
                                   modulec_options, tiny_llama, write_checkpoint)

VARIANTS = ("modulec_1gpu", "modulec_zero1", "modulec_zero2", "modulec_zero3", "modulec_tp2",
            "hf_ddp", "hf_ddp_compile", "hf_fsdp2", "hf_fsdp2_compile")
LLAMA3_VARIANTS = ("modulec_zero3", "hf_fsdp2_ckpt", "hf_fsdp2_ckpt_compile")
LLAMA3_8B = dict(vocab_size=128256, d_model=4096, n_layers=32, num_heads=32, num_kv_heads=8,
                 d_ff=14336, max_seq=8192, eps=1e-5, rope_theta=500000.0)
# the CPU check's shape (--device cpu): every code path, seconds per step on gloo
TINY = dict(vocab_size=512, d_model=64, n_layers=2, num_heads=4, num_kv_heads=2, d_ff=128,
            max_seq=256, eps=1e-5)
MODULEC_BASE = "modulec_norecompute"  # train_step.py's variant the modulec rows mirror


def shape_of(args) -> dict:
    if args.shape == "llama3-8b":
        shape = dict(LLAMA3_8B)
    elif args.shape == "tiny":
        shape = dict(TINY)
    else:
        shape = tiny_llama(22)
    return dict(shape, n_layers=args.layers) if args.layers else shape


# ------------------------------------------------------------------ ranks and timing (child)
class Ranks:
    """This process's place in the run: rank, world, device; collectives for reporting."""

    def __init__(self, device: str):
        import torch
        import torch.distributed as dist

        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local = int(os.environ.get("LOCAL_RANK", "0"))
        self.kind = device
        self.device = torch.device(f"cuda:{self.local}" if device == "cuda" else "cpu")
        if device == "cuda":
            torch.cuda.set_device(self.local)
        if self.world > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if device == "cuda" else "gloo")

    def sync(self) -> None:
        import torch
        import torch.distributed as dist

        if self.kind == "cuda":
            torch.cuda.synchronize()
        if self.world > 1:
            dist.barrier()

    def reduce(self, values: list[float], op: str) -> list[float]:
        """Elementwise max or mean of `values` over ranks."""
        import torch
        import torch.distributed as dist

        if self.world == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        return [v / self.world if op == "mean" else v for v in t.tolist()]

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def batch_for(args, vocab: int, ranks: Ranks):
    """Rank r's [B, T] int32 tokens (seed 1 + r; rank 0's is train_step.py's batch)."""
    import torch

    g = torch.Generator().manual_seed(1 + ranks.rank)
    return torch.randint(0, vocab, (args.batch, args.seq), generator=g,
                         dtype=torch.int32).to(ranks.device)


def timed(step, ranks: Ranks, warmup: int, steps: int) -> dict:
    """Median step time, every step started together on all ranks (see the docstring)."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        ranks.sync()
        began = time.perf_counter()
        step()
        if ranks.kind == "cuda":
            import torch

            torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    times = sorted(ranks.reduce(times, "max"))
    return {"step_s": times[len(times) // 2], "step_s_min": times[0], "step_s_max": times[-1]}


def timed_b2b(step, ranks: Ranks, steps: int) -> float | None:
    """train_step.py's own timer (CUDA events, back-to-back steps), max over ranks."""
    if ranks.kind != "cuda":
        return None
    from benchmarks.train_step import _timed

    ranks.sync()
    return ranks.reduce([_timed(step, 0, steps)["step_s"]], "max")[0]


def peak_bytes(ranks: Ranks) -> float | None:
    import torch

    if ranks.kind != "cuda":
        return None
    return ranks.reduce([float(torch.cuda.max_memory_allocated())], "max")[0]


def device_name(ranks: Ranks) -> str:
    import torch

    return torch.cuda.get_device_name() if ranks.kind == "cuda" else "cpu"


def reset_peak(ranks: Ranks) -> None:
    import torch

    if ranks.kind == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


# ------------------------------------------------------------------ communication exposed
def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def covered(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the intersection of two unions of disjoint sorted intervals."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def comm_times(trace_events: list[dict]) -> tuple[float, float, int]:
    """(NCCL kernel time, the part of it no other GPU work overlaps, kernels seen) in us,
    from a chrome trace's device events."""
    comm, busy, seen = [], [], 0
    for e in trace_events:
        if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset") or "dur" not in e:
            continue
        seen += 1
        span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        (comm if "nccl" in e.get("name", "").lower() else busy).append(span)
    comm, busy = union(comm), union(busy)
    total = sum(b - a for a, b in comm)
    return total, total - covered(comm, busy), seen


def exposed_comm(step, ranks: Ranks, steps: int) -> dict:
    """Profile `steps` steps on every rank; NCCL time and its exposed part per step."""
    if ranks.kind != "cuda" or steps <= 0:
        return {}
    import torch
    from torch.profiler import ProfilerActivity, profile

    ranks.sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    total, exposed, seen = comm_times(events)
    table = kernel_table(events, steps)
    total, exposed, seen = ranks.reduce([total / steps, exposed / steps, seen], "max")
    if not seen:
        return {"comm_note": "the profiler saw no device kernels"}
    return {"comm_s": total / 1e6, "exposed_comm_s": exposed / 1e6, "kernels_rank0": table}


def kernel_table(trace_events: list[dict], steps: int, top: int = 12) -> dict:
    """Where one rank's GPU time goes, per step in ms: each stream's busy time (the union
    of its kernels', copies' and memsets' intervals), the span from the first to the last
    device event, and the `top` kernels by total time with their streams and counts. Run
    beside modulec_1gpu's table it splits a data-parallel step's extra time into kernels
    that ran longer (contention) and time no stream was busy (waiting)."""
    streams: dict[str, list] = {}
    names: dict[str, list] = {}
    for e in trace_events:
        if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset") or "dur" not in e:
            continue
        start, dur = float(e["ts"]), float(e["dur"])
        stream = str(e.get("args", {}).get("stream", "?"))
        streams.setdefault(stream, []).append((start, start + dur))
        entry = names.setdefault(e.get("name", "?")[:90], [0.0, 0, set()])
        entry[0] += dur
        entry[1] += 1
        entry[2].add(stream)
    if not streams:
        return {}
    spans = [s for spans in streams.values() for s in spans]
    all_busy = union(spans)
    ms = lambda us: round(us / 1e3 / steps, 3)  # noqa: E731
    return {"span_ms": ms(max(b for _, b in spans) - min(a for a, _ in spans)),
            "any_stream_busy_ms": ms(sum(b - a for a, b in all_busy)),
            "stream_busy_ms": {k: ms(sum(b - a for a, b in union(v)))
                               for k, v in sorted(streams.items())},
            "top": [{"name": n, "ms": ms(t), "calls": c // steps, "streams": sorted(st)}
                    for n, (t, c, st) in sorted(names.items(), key=lambda kv: -kv[1][0])[:top]]}


def measure(step, loss_of, ranks: Ranks, args) -> dict:
    """Timing, peak, loss and communication of a prepared step (peak counters reset)."""
    result = timed(step, ranks, args.warmup, args.steps)
    result["peak_bytes"] = peak_bytes(ranks)
    result["loss"] = ranks.reduce([loss_of()], "mean")[0]
    result["step_s_b2b"] = timed_b2b(step, ranks, args.steps)
    save(args, ranks, result)  # kept if the profiler fails or crashes the process
    try:
        result.update(exposed_comm(step, ranks, args.profile_steps))
    except Exception as exc:  # the timings stand without it
        result["comm_note"] = f"profiler failed: {type(exc).__name__}: {exc}"[:200]
    return result


def save(args, ranks: Ranks, result: dict) -> None:
    if ranks.rank == 0:
        Path(args.result).write_text(json.dumps(dict(result, gpus=ranks.world)))


# ------------------------------------------------------------------ modulec (child)
def modulec_dist(ctx, variant: str, gpus: int):
    """The `dist=` argument of TrainStep.from_module for a distributed modulec variant,
    or a RuntimeError saying which part of the API is missing."""
    if variant == "modulec_tp2":
        if not hasattr(ctx, "tensor_parallel"):
            raise RuntimeError("not available: runtime.dist.DistContext has no tensor_parallel")
        return ctx.tensor_parallel(size=gpus)
    if not hasattr(ctx, "data_parallel"):
        raise RuntimeError("modulec data-parallel API missing: "
                           "runtime.dist.DistContext has no data_parallel(zero=...)")
    return ctx.data_parallel(zero=int(variant[len("modulec_zero"):]))


def modulec_step(args, shape, ranks: Ranks, variant: str):
    """TrainStep as train_step.py builds `modulec_norecompute`, with `dist=` on >1 rank."""
    try:
        from runtime.cuda.step import TrainStep
        from runtime.dist import DistContext
    except ImportError as exc:
        raise RuntimeError(f"modulec data-parallel API missing: {exc}") from None
    options = modulec_options(MODULEC_BASE)
    if variant.endswith("_fp8"):
        options["precision"] = "fp8"
        variant = variant[:-len("_fp8")]
    if args.budget:
        options["memory_budget"] = int(args.budget * 2 ** 30)
    if variant == "modulec_1gpu":
        return TrainStep.from_module(ROOT / "std/models/llama.module", shape, batch=args.batch,
                                     seq=args.seq, **options), None
    if "dist" not in getattr(TrainStep, "__dataclass_fields__", {}):
        raise RuntimeError("modulec data-parallel API missing: TrainStep takes no dist=")
    ctx = DistContext.from_env(device="cuda")
    options["dist"] = modulec_dist(ctx, variant, ranks.world)
    return TrainStep.from_module(ROOT / "std/models/llama.module", shape, batch=args.batch,
                                 seq=args.seq, **options), ctx


def run_modulec(args, shape, ranks: Ranks, variant: str) -> dict:
    """One GPU: train_step.py's weights (the HF checkpoint); distributed: init_random(0)."""
    import torch

    step, ctx = modulec_step(args, shape, ranks, variant)
    if ctx is None and args.ckpt:
        from runtime.hf_weights import load_hf_weights

        weights = load_hf_weights(step.program.weight_schema, args.ckpt, dtype=torch.float32,
                                  device="cuda")
        step.load(weights)
        del weights
    else:
        step.init_random(0)
    tokens = batch_for(args, shape["vocab_size"], ranks)
    step.set_batch(tokens)
    reset_peak(ranks)
    step.capture(warmup=2)
    result = measure(lambda: step(tokens), lambda: float(step.loss), ranks, args)
    zero = getattr(step, "zero", None)
    if zero is not None and hasattr(zero, "fixed_bytes"):
        result["fixed_bytes"] = ranks.reduce([float(zero.fixed_bytes())], "max")[0]
    return result


# ------------------------------------------------------------------ HF peers (child)
def hf_options(variant: str) -> dict:
    """hf_{ddp|fsdp2}[_compile|_compilewhole|_compilelayers][_ckpt]."""
    parts = variant.split("_")[1:]
    wrap, flags = parts[0], set(parts[1:])
    unknown = flags - {"compile", "compilewhole", "compilelayers", "ckpt", "fp8"}
    if wrap not in ("ddp", "fsdp2") or unknown:
        raise ValueError(f"unknown HF variant {variant!r}")
    compile_ = ("whole" if "compilewhole" in flags else "layers" if "compilelayers" in flags
                else None)
    if "compile" in flags:
        compile_ = "whole" if wrap == "ddp" else "layers"
    return {"wrap": wrap, "compile": compile_, "ckpt": "ckpt" in flags, "fp8": "fp8" in flags}


def hf_model(args, shape):
    """fp32 LlamaForCausalLM on the CPU from the checkpoint; without one (the llama3-8b
    shape) on the meta device, materialized by `materialize` after sharding."""
    import torch
    from transformers import LlamaForCausalLM

    if args.ckpt:
        model = LlamaForCausalLM.from_pretrained(args.ckpt, torch_dtype=torch.float32,
                                                 attn_implementation="sdpa")
    else:
        with torch.device("meta"):
            model = LlamaForCausalLM(hf_config(shape)).float()
    model.config.use_cache = False
    return model


def materialize(model, ranks: Ranks) -> None:
    """A meta model's (local shards of) parameters on the device: normal(0, 0.02), the
    norms' weights 1 (speed does not depend on the values); the RoPE tables rebuilt."""
    import torch

    if not any(p.is_meta for p in model.parameters()):
        return
    model.to_empty(device=ranks.device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.fill_(1.0) if name.endswith("norm.weight") else local.normal_(0.0, 0.02)
    rope = model.model.rotary_emb
    with ranks.device:  # transformers' signatures differ: the default device instead
        model.model.rotary_emb = type(rope)(model.config)


def checkpointed(model) -> None:
    """Every decoder layer recomputed in the backward (non-reentrant torch checkpoint);
    transformers 5 renamed gradient_checkpointing_enable."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def wrap_ddp(model, ranks: Ranks, options: dict):
    """DDP on the device; compile the DDP module whole, or each decoder layer before."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    materialize(model, ranks)
    model = model.to(ranks.device)
    if options["ckpt"]:
        checkpointed(model)
    if options["compile"] == "layers":
        for layer in model.model.layers:
            layer.compile()
    ids = [ranks.local] if ranks.kind == "cuda" else None
    ddp = DDP(model, device_ids=ids, gradient_as_bucket_view=True)
    return model, (torch.compile(ddp) if options["compile"] == "whole" else ddp)


def wrap_fsdp2(model, ranks: Ranks, options: dict):
    """fully_shard per decoder layer, then the root; compile per layer before sharding."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(ranks.kind, (ranks.world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if options["ckpt"]:
        checkpointed(model)
    for layer in model.model.layers:
        if options["compile"] == "layers":
            layer.compile()
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)  # moves the shards to the device
    return model, (torch.compile(model) if options["compile"] == "whole" else model)


def run_hf(args, shape, ranks: Ranks, variant: str) -> dict:
    import torch

    options = hf_options(variant)
    model = hf_model(args, shape)
    model.train()
    if options["fp8"]:
        from benchmarks.train_step import to_float8

        to_float8(model)
    wrap = wrap_ddp if options["wrap"] == "ddp" else wrap_fsdp2
    model, forward = wrap(model, ranks, options)
    materialize(model, ranks)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), fused=True)
    tokens = batch_for(args, shape["vocab_size"], ranks).long()
    autocast = options["wrap"] == "ddp"  # FSDP2's policy casts the parameters itself
    box = {}

    def step():
        with torch.autocast(ranks.kind, dtype=torch.bfloat16, enabled=autocast):
            loss = forward(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        box["loss"] = loss.detach()

    reset_peak(ranks)
    result = measure(step, lambda: float(box["loss"]), ranks, args)
    result["compile"] = options["compile"]
    return result


def child(args) -> None:
    ranks = Ranks(args.device)
    shape = shape_of(args)
    try:
        if args.only.startswith("modulec"):
            result = run_modulec(args, shape, ranks, args.only)
        else:
            result = run_hf(args, shape, ranks, args.only)
        result["gpus"] = ranks.world
        result["device"] = device_name(ranks)
    except Exception as exc:  # one line for the table; the traceback goes to stderr
        import traceback

        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {exc}"[:400], "gpus": ranks.world}
    save(args, ranks, result)
    if ranks.world > 1 and args.device == "cuda":
        # destroy_process_group can hang after collectives captured in a CUDA graph
        # (runtime.dist.context.DistContext.exit_now): end at once, outputs flushed
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    ranks.close()


# ------------------------------------------------------------------ the run (parent)
def launch(args, variant: str, ckpt: Path | None, out: Path) -> dict:
    """The variant in its own process(es); NCCL_NVLS_ENABLE=0 always."""
    gpus = 1 if variant in ("modulec_1gpu", "modulec_1gpu_fp8") else args.gpus
    prefix = [sys.executable]
    if gpus > 1:
        prefix += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(gpus)]
    cmd = prefix + [__file__, "--only", variant, "--result", str(out), "--device", args.device,
                    "--shape", args.shape, "--batch", str(args.batch), "--seq", str(args.seq),
                    "--steps", str(args.steps), "--warmup", str(args.warmup),
                    "--profile-steps", str(args.profile_steps)]
    cmd += ["--layers", str(args.layers)] if args.layers else []
    cmd += ["--ckpt", str(ckpt)] if ckpt else []
    cmd += ["--budget", str(args.budget)] if args.budget else []
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONPATH=_pythonpath())
    if args.device == "cpu":
        env.setdefault("OMP_NUM_THREADS", "1")
    output, timed_out = run_group(cmd, env, args.timeout)
    if args.json:  # the processes' own output beside the JSON, for the failures
        Path(f"{args.json}.{variant}.log").write_text(output)
    if out.exists():  # a profiler that hung still leaves the timings
        return json.loads(out.read_text())
    if timed_out:
        return {"error": f"timed out after {args.timeout} s", "gpus": gpus}
    return {"error": output[-1500:], "gpus": gpus}


def run_group(cmd: list[str], env: dict, timeout: int) -> tuple[str, bool]:
    """Run `cmd` in a session of its own; past `timeout`, kill the whole session (torchrun's
    workers too, so no orphan keeps a GPU's memory). (stdout + stderr, timed out)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    try:
        return proc.communicate(timeout=timeout)[0], False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.communicate()[0], True


def _pythonpath() -> str:
    rest = os.environ.get("PYTHONPATH")
    return f"{ROOT}{os.pathsep}{rest}" if rest else str(ROOT)


def check_variant(name: str) -> None:
    """Unknown names end the run before anything starts."""
    if name.startswith("hf_"):
        hf_options(name)
        return
    name = name[:-len("_fp8")] if name.endswith("_fp8") else name
    if name not in ("modulec_1gpu", "modulec_tp2") and name not in {
            f"modulec_zero{z}" for z in range(4)}:
        raise ValueError(f"unknown variant {name!r} (modulec_1gpu, modulec_zero0..3, "
                         "modulec_tp2, each [_fp8]; hf_{ddp|fsdp2}[_compile|"
                         "_compilewhole|_compilelayers][_ckpt][_fp8])")


def tp_missing() -> str | None:
    """Why modulec_tp2 cannot run here (checked without starting processes)."""
    try:
        from runtime.dist import DistContext
    except ImportError as exc:
        return f"not available: {exc}"
    if not hasattr(DistContext, "tensor_parallel"):
        return "not available: runtime.dist.DistContext has no tensor_parallel"
    return None


def derive(rows: dict, args, flops: float) -> None:
    """tokens/s (total, per GPU), MFU per GPU and scaling, from each row's step time."""
    one = rows.get("modulec_1gpu", {})
    base = args.batch * args.seq / one["step_s"] if "step_s" in one else None
    for name, r in rows.items():
        if "step_s" not in r:
            continue
        r["tokens_per_s"] = args.batch * args.seq * r["gpus"] / r["step_s"]
        r["tokens_per_s_per_gpu"] = r["tokens_per_s"] / r["gpus"]
        r["mfu_989"] = (r["tokens_per_s_per_gpu"] * flops / PEAK if args.device == "cuda"
                        else None)
        r["scaling"] = r["tokens_per_s"] / (r["gpus"] * base) if base else None
        # data parallel runs one GPU's step per rank: what a step takes beyond it is what
        # data parallel costs (exposed collectives, waiting for the slower rank, kernels
        # slowed by the overlapped ones); the profiler's `exposed` cannot see inside replays
        r["over_1gpu_s"] = r["step_s"] - one["step_s"] if base and \
            name.startswith("modulec_zero") and not name.endswith("_fp8") else None


def _fmt(value, width: int, spec: str, scale: float = 1.0) -> str:
    return f"{value * scale:>{width}{spec}}" if value is not None else f"{'-':>{width}}"


def table(rows: dict, args, shape: dict) -> str:
    lines = [f"{args.shape} shape, {shape['n_layers']} layers, B={args.batch} per GPU "
             f"T={args.seq}, bf16 (fp32 master), fwd+bwd+AdamW, {args.device}",
             f"{'variant':<26}{'GPUs':>5}{'tok/s':>9}{'tok/s/GPU':>10}{'step ms':>9}"
             f"{'b2b ms':>8}{'peak GiB':>9}{'MFU989':>7}{'scaling':>8}{'comm ms':>8}"
             f"{'exposed':>8}{'+ms/1GPU':>9}{'loss':>8}{'fixed GiB':>10}"]
    for name, r in rows.items():
        if "step_s" not in r:
            why = r.get("unavailable") or r.get("error", "?").strip().splitlines()[-1]
            lines.append(f"{name:<26}{r.get('gpus', ''):>5}  {why[:110]}")
            continue
        lines.append(
            f"{name:<26}{r['gpus']:>5}{r['tokens_per_s']:>9.0f}{r['tokens_per_s_per_gpu']:>10.0f}"
            f"{r['step_s'] * 1e3:>9.1f}{_fmt(r.get('step_s_b2b'), 8, '.1f', 1e3)}"
            f"{_fmt(r.get('peak_bytes'), 9, '.2f', 2 ** -30)}{_fmt(r.get('mfu_989'), 7, '.1%')}"
            f"{_fmt(r.get('scaling'), 8, '.2f')}{_fmt(r.get('comm_s'), 8, '.1f', 1e3)}"
            f"{_fmt(r.get('exposed_comm_s'), 8, '.1f', 1e3)}"
            f"{_fmt(r.get('over_1gpu_s'), 9, '.1f', 1e3)}{r['loss']:>8.3f}"
            f"{_fmt(r.get('fixed_bytes'), 10, '.2f', 2 ** -30)}")
    return "\n".join(lines)


def run_all(args, shape: dict, ckpt: Path | None, tmp: Path, report) -> dict:
    """Every variant in turn; `report(rows)` after each (a partial JSON survives a kill)."""
    rows = {}
    for variant in args.variants.split(","):
        why = tp_missing() if variant == "modulec_tp2" else None
        if why:
            rows[variant] = {"unavailable": why, "gpus": args.gpus}
        else:
            rows[variant] = launch(args, variant, ckpt, tmp / f"{variant}.json")
        print(f"{variant}: {rows[variant]}", file=sys.stderr, flush=True)
        report(rows)
    return rows


def parent(args) -> None:
    shape = shape_of(args)
    flops = flops_per_token(shape, args.seq)
    head = {"shape": args.shape, "model": shape, "batch_per_gpu": args.batch,
            "seq": args.seq, "layers": shape["n_layers"], "gpus": args.gpus,
            "flops_per_token": flops, "peak_flops": PEAK, **_versions()}

    def report(rows: dict) -> str:
        derive(rows, args, flops)
        devices = sorted({r["device"] for r in rows.values() if "device" in r})
        text = json.dumps(dict(head, device=", ".join(devices), variants=rows), indent=2)
        if args.json:
            Path(args.json).write_text(text)
        return text

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = None
        if args.shape != "llama3-8b":  # 8B: each rank initializes (no 32 GB file)
            ckpt = Path(tmp) / "ckpt"
            write_checkpoint(shape, ckpt)
        rows = run_all(args, shape, ckpt, Path(tmp), report)
    text = report(rows)
    print(table(rows, args, shape))
    print(text)


def _versions() -> dict:
    """The parent touches no GPU (no CUDA context beside the variants' processes)."""
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=["tinyllama", "llama3-8b", "tiny"],
                        default="tinyllama", help="tiny: the CPU check's shape")
    parser.add_argument("--batch", type=int, help="per GPU (default 4; llama3-8b: 1)")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--layers", type=int, help="fewer layers than the shape's")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--profile-steps", type=int, default=2,
                        help="steps under torch.profiler for the communication figures")
    parser.add_argument("--gpus", type=int, default=2, help="processes per distributed variant")
    parser.add_argument("--variants", help="comma-separated (default: all for the shape)")
    parser.add_argument("--budget", type=float, help="modulec: GiB per GPU for the step")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: gloo on CPU processes, only to check the HF code paths")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per variant")
    parser.add_argument("--json")
    parser.add_argument("--only", help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.batch is None:
        args.batch = 1 if args.shape == "llama3-8b" else 4
    if args.variants is None:
        args.variants = ",".join(LLAMA3_VARIANTS if args.shape == "llama3-8b" else VARIANTS)
    try:
        for name in args.variants.split(","):
            check_variant(name)
    except ValueError as exc:
        parser.error(str(exc))
    child(args) if args.only else parent(args)


if __name__ == "__main__":
    main()
