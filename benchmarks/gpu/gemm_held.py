"""Do the LoRA 8B step's GEMM choices (runtime/cuda/gemm.py, timed in bursts at full clock)
still win when the card runs at its power cap, as it does through a step? Records the
problems the step tunes (one eager step), then times torch's call and each cuBLASLt
candidate in bursts (the tuner's way) and held (0.25 s back to back, then 0.25 s timed).
Results and what came of them: docs/decisions.md "GEMM algorithms timed per problem".

    python3 benchmarks/gpu/gemm_held.py      # one GPU, ~2 min at LoRA 8B
"""
import sys, time
from pathlib import Path
ROOT = Path.cwd()
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks" / "gpu")]
import torch
from runtime.cuda import gemm
from runtime.cuda.build import load

recorded = {}
orig = gemm._tune


def meta(t):
    return (tuple(t.shape), tuple(t.stride()), t.dtype, gemm._align(t))


def rec(key, a, b, out, beta):
    recorded[key] = (meta(a), meta(b), meta(out), beta)
    return orig(key, a, b, out, beta)


gemm._tune = rec
from runtime.cuda.step import AdamWConfig, TrainStep
from lora_peers import SHAPES, TARGETS
from benchmarks.harness import random_tokens

shape = SHAPES["llama3-8b"]
step = TrainStep.from_module(ROOT / "std/models/llama.module", shape, batch=1, seq=2048,
                             lora=dict(rank=16, alpha=32, targets=list(TARGETS)),
                             adamw=AdamWConfig(lr=1e-4))
step.init_random(0)
tokens = random_tokens(1, 2048, shape["vocab_size"], dtype=torch.int64).to(torch.int32)
step.set_batch(tokens)
step(tokens)
torch.cuda.synchronize()
timings = dict(gemm._timings)
del step
torch.cuda.empty_cache()


def make(m):
    shape_, stride, dtype, align = m
    span = 1 + sum((s - 1) * st for s, st in zip(shape_, stride))
    off = (align % 256) // 2
    base = torch.randn(span + off + 128, device="cuda").to(dtype)
    return base[off:off + span].as_strided(shape_, stride)


def sustained(run, seconds=0.25):
    """ms per call of `run` held: back to back for `seconds`, then as many calls timed."""
    torch.cuda.synchronize()
    t0 = time.perf_counter(); n = 0
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            run()
        n += 10
        torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        run()
    stop.record(); stop.synchronize()
    return start.elapsed_time(stop) / n


rows = sorted(recorded.items(), key=lambda kv: -timings[kv[0]][0])
rows = [kv for kv in rows if timings[kv[0]][0] > 0.08][:12]
total_gain = 0.0
for key, (ma, mb, mo, beta) in rows:
    a, b, out = make(ma), make(mb), make(mo)
    found = load().gemm_candidates(a, b, out, beta != 0.0, gemm.TUNE_CANDIDATES)
    runs = {"torch": lambda: gemm._torch_mm(a, b, out, 1.0, beta)}
    runs.update({i: (lambda i=i: gemm._lt(a, b, out, 1.0, beta, i)) for i in gemm._running(a, b, out, beta, found)})
    burst = dict(zip(runs, gemm._median_times(list(runs.values()))))
    sus = {k: [] for k in runs}
    for _ in range(2):
        for k, r in runs.items():
            sus[k].append(sustained(r))
    sus = {k: min(v) for k, v in sus.items()}
    pick = min(burst, key=burst.get)
    best = min(sus, key=sus.get)
    gain = sus[pick] - sus[best]
    print(f"{ma[0]}x{mb[0]}: a{ma[0]} b{mb[0]} out{mo[0]} strides {ma[1]} {mb[1]} beta={beta}: "
          f"burst pick {pick} ({burst[pick]:.3f} ms), sustained: pick {sus[pick]:.3f} ms, best {best} {sus[best]:.3f} ms (gain {gain*1000:.1f} us)")
    print("   burst    ", " ".join(f"{k}:{v:.3f}" for k, v in burst.items()))
    print("   sustained", " ".join(f"{k}:{v:.3f}" for k, v in sus.items()))
