"""One training step (forward + backward + AdamW, bf16 compute, fp32 master weights) on
the GPUs of one host, data and tensor parallel, side by side in one run (issue 17, item
8; issue 20):

    modulec_zero{S}  modulec's data parallel (runtime.dist.DistContext.data_parallel)
                 over every GPU, ZeRO stage S (0: replicated state, the reference for the
                 fixed bytes); the step built as train_step.py's `modulec_norecompute`
                 (the derived backward, fused AdamW inside the backward, arena), the whole
                 step with its collectives in one CUDA graph
    modulec_zero{S}_tp{M}  tensor parallel over M consecutive GPUs, data parallel with
                 ZeRO stage S over the GPUS / M TP groups: ctx.data_parallel(zero=S, tp=M)
                 (DP 2 x TP 2 on 4 GPUs: modulec_zero1_tp2; TP over all GPUs:
                 modulec_zero0_tp{GPUS}); `_tp{M}_sp`: with sequence parallel;
                 `_nooverlap` (after `_tp{M}` / `_sp`): the program built with
                 --no-tp-overlap, each backward all-reduce / reduce-scatter in order
                 instead of beside the weight gradient's GEMM (the overlap's A/B). What the
                 GPU step supports and refuses: benchmarks/dist_modulec.py
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
                 llama3 shapes, where nothing else fits)
    ..._fp8      suffix: FP8 matmuls. modulec: the std FP8 recipe (`--precision fp8`,
                 runtime/fp8_gemm.py); HF: torchao's convert_to_float8_training on the
                 decoder's linears before sharding (tensorwise dynamic scaling, the LM head
                 in bf16; torchao must be importable). Each is the other's FP8 peer; the
                 bf16 rows stay the issue's comparison

Shapes (--shape): tinyllama (22 layers), llama3-8b, llama3-70b (80 layers, d_model 8192,
64 heads, 8 KV heads, d_ff 28672, vocabulary 128256: with --layers N a cut of its stack,
the embedding and LM head whole), tiny (the CPU check's). Every variant runs in its own
process group (`torchrun --standalone --nproc-per-node GPUS`, or one plain process for
modulec_1gpu; benchmarks/harness.py's runner: past --timeout killed with torchrun's
workers), NCCL_NVLS_ENABLE=0 always, so peak-memory counters start clean. HF
variants start from the HF checkpoint train_step.py writes (random weights; the llama3
shapes are initialized on each rank instead, fp32 at 0.02, so no checkpoint is
written); modulec's distributed variants from `init_random(0)`; data-parallel rank r
trains on its own random batch (generator seed 1 + r: rank 0's is the one-GPU batch),
the ranks of one TP group on the same one.

What is measured, per variant:
  step_ms       median over --steps timed steps after --warmup steps: before each step
                every rank synchronizes its device and meets the others at a barrier; a
                step ends when its device is idle; the step's time is the max over ranks
  step_ms_b2b   train_step.py's timer (CUDA events around back-to-back steps, no host
                sync between them), max over ranks of each rank's median
  tokens/s      B x T x DP / step time (DP = GPUs / TP: a TP group trains one batch),
                and per GPU; MFU per GPU as train_step.py (tokens/s per GPU x
                flops_per_token against 989 TFLOP/s)
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
  +ms/1GPU      modulec data parallel (TP 1): its step time less modulec_1gpu's (each
                rank runs one GPU's step on its own batch): what data parallel costs a
                step, exposed communication, rank imbalance and overlap contention
  fixed         modulec under ZeRO: the fixed state a rank holds (step.zero.fixed_bytes)
  loss          the last timed step's loss, mean over ranks (each rank's own batch)
  wall          seconds from the variant's launch to its end (start-up, build or
                compile, warm-up, timing, profiling): what it takes of a device call

--device cpu runs the variants on gloo CPU processes at --shape tiny, modulec's with the
CPU trainer (runtime/train): a check of their code paths (tests/test_dist_bench.py), not
a measurement. --budget GiB builds modulec's steps with the budget planner
(TrainStep.from_module(memory_budget=...)). --deadline S bounds the whole run: each
variant's timeout is cut to what is left of S (a device call has a fixed length); a
variant left less than 20 s is not started (its row says so).

    python benchmarks/train_step_dist.py [--variants modulec_zero2,hf_fsdp2_compile,...]
        [--steps 10] [--layers 22] [--batch 4] [--seq 2048] [--json out.json]
        [--shape tinyllama|llama3-8b|llama3-70b] [--gpus 2] [--device cpu]
        [--timeout 900] [--deadline S]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import harness  # noqa: E402
from benchmarks.dist_measure import Ranks, device_name, save  # noqa: E402
from benchmarks.dist_modulec import parse_variant, run_modulec  # noqa: E402
from benchmarks.dist_peers import hf_options, run_hf  # noqa: E402
from benchmarks.harness import (PEAK, Column, Deadline, command, finish,  # noqa: E402
                                forward_args, header, progress, table_rows)
from benchmarks.train_step import flops_per_token, tiny_llama, write_checkpoint  # noqa: E402

VARIANTS = ("modulec_1gpu", "modulec_zero1", "modulec_zero2", "modulec_zero3",
            "modulec_zero0_tp2", "hf_ddp", "hf_ddp_compile", "hf_fsdp2", "hf_fsdp2_compile")
LLAMA3_VARIANTS = ("modulec_zero3", "hf_fsdp2_ckpt", "hf_fsdp2_ckpt_compile")
LLAMA3_8B = dict(vocab_size=128256, d_model=4096, n_layers=32, num_heads=32, num_kv_heads=8,
                 d_ff=14336, max_seq=8192, eps=1e-5, rope_theta=500000.0)
# Llama-3-70B (head_dim 128 = d_model / num_heads); cut with --layers
LLAMA3_70B = dict(vocab_size=128256, d_model=8192, n_layers=80, num_heads=64, num_kv_heads=8,
                  d_ff=28672, max_seq=8192, eps=1e-5, rope_theta=500000.0)
# the CPU check's shape (--device cpu): every code path, seconds per step on gloo
TINY = dict(vocab_size=512, d_model=64, n_layers=2, num_heads=4, num_kv_heads=2, d_ff=128,
            max_seq=256, eps=1e-5)
SHAPES = {"tinyllama": tiny_llama(22), "llama3-8b": LLAMA3_8B, "llama3-70b": LLAMA3_70B,
          "tiny": TINY}
INIT_ON_RANKS = ("llama3-8b", "llama3-70b")  # no HF checkpoint written: each rank draws


def shape_of(args) -> dict:
    shape = dict(SHAPES[args.shape])
    return dict(shape, n_layers=args.layers) if args.layers else shape


def default_variants(args) -> str:
    if args.shape == "llama3-70b":
        return f"modulec_zero0_tp{args.gpus},hf_fsdp2_ckpt_compile"
    return ",".join(LLAMA3_VARIANTS if args.shape in INIT_ON_RANKS else VARIANTS)


def child(args) -> None:
    ranks = Ranks(args.device)
    shape = shape_of(args)
    try:
        if args.only.startswith("modulec"):
            layout = parse_variant(args.only, ranks.world, shape)
            result = run_modulec(args, shape, ranks, layout)
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
def launch(args, variant: str, ckpt: Path | None, out: Path, timeout: float) -> dict:
    """The variant in its own process(es) through harness.launch (torchrun over the GPUs,
    or one process for modulec_1gpu; past `timeout` killed with torchrun's workers), NVLink
    multicast off always (NCCL, torch's symmetric memory, NVSHMEM). Its row with `wall_s`
    (launch to end: plans a device call); a row the child did not write with `gpus`."""
    gpus = parse_variant(variant, args.gpus).gpus if variant.startswith("modulec") \
        else args.gpus
    cmd = command(__file__, gpus) + ["--only", variant, "--result", str(out), "--device",
                                     args.device, "--shape", args.shape]
    cmd += forward_args(args, "batch", "seq", "steps", "warmup", "profile_steps", "layers",
                        "budget")
    cmd += ["--ckpt", str(ckpt)] if ckpt else []
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
               NVSHMEM_DISABLE_NVLS="1")
    if args.device == "cpu":
        env.setdefault("OMP_NUM_THREADS", "1")
    began = time.monotonic()
    # the processes' own output beside the JSON, for the failures; a row written before a
    # profiler hung still counts
    log = Path(f"{args.json}.{variant}.log") if args.json else None
    row = harness.launch(cmd, out, timeout, log, env)
    row.setdefault("gpus", gpus)
    row["wall_s"] = round(time.monotonic() - began, 1)
    return row


def check_variant(name: str, gpus: int, shape: dict) -> None:
    """Unknown names, and layouts the GPUs or the shape cannot take, end the run before
    anything starts (ValueError)."""
    if name.startswith("hf_"):
        hf_options(name)
    else:
        parse_variant(name, gpus, shape)


def derive(rows: dict, args, flops: float) -> None:
    """tokens/s (total, per GPU), MFU per GPU and scaling, from each row's step time: a
    step trains B x T x DP tokens (DP = GPUs / TP; a TP group shares one batch)."""
    one = rows.get("modulec_1gpu", {})
    base = args.batch * args.seq / one["step_s"] if "step_s" in one else None
    for name, r in rows.items():
        if "step_s" not in r:
            continue
        r["tokens_per_s"] = args.batch * args.seq * r.get("dp", r["gpus"]) / r["step_s"]
        r["tokens_per_s_per_gpu"] = r["tokens_per_s"] / r["gpus"]
        r["mfu_989"] = (r["tokens_per_s_per_gpu"] * flops / PEAK if args.device == "cuda"
                        else None)
        r["scaling"] = r["tokens_per_s"] / (r["gpus"] * base) if base else None
        # data parallel runs one GPU's step per rank: what a step takes beyond it is what
        # data parallel costs (exposed collectives, waiting for the slower rank, kernels
        # slowed by the overlapped ones); the profiler's `exposed` cannot see inside replays
        r["over_1gpu_s"] = r["step_s"] - one["step_s"] if base and r.get("tp", 1) == 1 \
            and name.startswith("modulec_zero") and not name.endswith("_fp8") else None


WIDTH = 26  # the variant column
COLUMNS = [Column("GPUs", 5, "gpus", "d"),
           Column("DPxTP", 6, "dp", "", value=lambda r: f"{r.get('dp', r['gpus'])}x"
                                                         f"{r.get('tp', 1)}"),
           Column("tok/s", 9, "tokens_per_s", ".0f"),
           Column("tok/s/GPU", 10, "tokens_per_s_per_gpu", ".0f"),
           Column("step ms", 9, "step_s", ".1f", 1e3),
           Column("b2b ms", 8, "step_s_b2b", ".1f", 1e3),
           Column("peak GiB", 9, "peak_bytes", ".2f", 2 ** -30),
           Column("MFU989", 7, "mfu_989", ".1%"), Column("scaling", 8, "scaling", ".2f"),
           Column("comm ms", 8, "comm_s", ".1f", 1e3),
           Column("exposed", 8, "exposed_comm_s", ".1f", 1e3),
           Column("+ms/1GPU", 9, "over_1gpu_s", ".1f", 1e3), Column("loss", 8, "loss", ".3f"),
           Column("fixed GiB", 10, "fixed_bytes", ".2f", 2 ** -30),
           Column("wall s", 7, "wall_s", ".0f")]


def _not_measured(name: str, row: dict, why: str) -> str:
    """A failed or not-run variant: its GPUs, then why."""
    return f"{name:<{WIDTH}}{row.get('gpus', ''):>5}  {why[:110]}"


def table(rows: dict, args, shape: dict) -> str:
    return "\n".join([
        f"{args.shape} shape, {shape['n_layers']} layers, B={args.batch} per data-parallel "
        f"rank T={args.seq}, bf16 (fp32 master), fwd+bwd+AdamW, {args.device}",
        header(COLUMNS, WIDTH), *table_rows(rows, COLUMNS, WIDTH, failed=_not_measured)])


def run_all(args, ckpt: Path | None, tmp: Path, report) -> dict:
    """Every variant in turn; `report(rows)` after each (a partial JSON survives a kill).
    Under --deadline each variant's timeout is what is left of it, at most --timeout; a
    variant left less than harness.MIN_VARIANT_S is not started."""
    rows, deadline = {}, Deadline(args.deadline or None)
    for variant in args.variants.split(","):
        timeout = deadline.timeout(args.timeout)
        if timeout is None:
            rows[variant] = dict(deadline.not_run(), gpus=args.gpus)
        else:
            rows[variant] = launch(args, variant, ckpt, tmp / f"{variant}.json", timeout)
        progress(variant, rows[variant])
        report(rows)
    return rows


def parent(args) -> None:
    shape = shape_of(args)
    flops = flops_per_token(shape, args.seq)
    head = {"shape": args.shape, "model": shape, "batch_per_gpu": args.batch,
            "seq": args.seq, "layers": shape["n_layers"], "gpus": args.gpus,
            "flops_per_token": flops, "peak_flops": PEAK, **_versions()}

    def summary(rows: dict) -> dict:
        derive(rows, args, flops)
        devices = sorted({r["device"] for r in rows.values() if "device" in r})
        return dict(head, device=", ".join(devices), variants=rows)

    def report(rows: dict) -> None:
        if args.json:
            Path(args.json).write_text(json.dumps(summary(rows), indent=2))

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = None
        if args.shape not in INIT_ON_RANKS:  # the llama3 shapes: each rank initializes
            ckpt = Path(tmp) / "ckpt"
            write_checkpoint(shape, ckpt)
        rows = run_all(args, ckpt, Path(tmp), report)
    final = summary(rows)
    finish(table(rows, args, shape), final, args.json)


def _versions() -> dict:
    """The parent touches no GPU (no CUDA context beside the variants' processes)."""
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tinyllama",
                        help="tiny: the CPU check's shape")
    parser.add_argument("--batch", type=int, help="per data-parallel rank (default 4; the "
                        "llama3 shapes: 1)")
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
                        help="cpu: gloo on CPU processes, only to check the code paths")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per variant")
    parser.add_argument("--deadline", type=int,
                        help="seconds for the whole run: each variant gets what is left")
    parser.add_argument("--json")
    parser.add_argument("--only", help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.batch is None:
        args.batch = 1 if args.shape in INIT_ON_RANKS else 4
    if args.variants is None:
        args.variants = default_variants(args)
    try:
        for name in args.variants.split(",") if not args.only else ():
            check_variant(name, args.gpus, shape_of(args))
    except ValueError as exc:
        parser.error(str(exc))
    child(args) if args.only else parent(args)


if __name__ == "__main__":
    main()
