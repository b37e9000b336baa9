"""Do the LoRA 8B step's GEMM choices (runtime/cuda/gemm.py, timed in bursts at full clock)
still win when the card runs at its power cap, as it does through a step? Records the
problems the step tunes (one eager step), then times torch's call and each cuBLASLt
candidate in bursts (the tuner's way) and held (HOLD s back to back, then as many calls
timed, with the card's energy over them: NVML's counter, benchmarks/harness.card_power),
printing ms and mJ a call held. Results and what came of them: docs/decisions.md "GEMM
algorithms timed per problem" and "LoRA step at the power cap".

    python3 benchmarks/gpu/gemm_held.py [HOLD] [PROBLEMS]   # one GPU; 0.25 s, 12 problems
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
from benchmarks.harness import card_power, random_tokens

HOLD = float(sys.argv[1]) if len(sys.argv) > 1 else 0.25
PROBLEMS = int(sys.argv[2]) if len(sys.argv) > 2 else 12

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


def sustained(run, seconds=None):
    """(ms, mJ) per call of `run` held: back to back for `seconds`, then as many calls
    timed, the card's energy read around them (mJ None without NVML)."""
    seconds = HOLD if seconds is None else seconds
    torch.cuda.synchronize()
    t0 = time.perf_counter(); n = 0
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            run()
        n += 10
        torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with card_power() as power:
        start.record()
        for _ in range(n):
            run()
        stop.record(); stop.synchronize()
    return start.elapsed_time(stop) / n, power["joules"] * 1e3 / n if power else None


rows = sorted(recorded.items(), key=lambda kv: -timings[kv[0]][0])
rows = [kv for kv in rows if timings[kv[0]][0] > 0.08][:PROBLEMS]
total_gain = 0.0
for key, (ma, mb, mo, beta) in rows:
    a, b, out = make(ma), make(mb), make(mo)
    found = load().gemm_candidates(a, b, out, beta != 0.0, gemm.TUNE_CANDIDATES)
    runs = {"torch": lambda: gemm._torch_mm(a, b, out, 1.0, beta)}
    runs.update({i: (lambda i=i: gemm._lt(a, b, out, 1.0, beta, i)) for i in gemm._running(a, b, out, beta, found)})
    burst = dict(zip(runs, gemm._median_times(list(runs.values()))))
    held = {k: sustained(r) for k, r in runs.items()}
    sus = {k: v[0] for k, v in held.items()}
    energy = {k: v[1] for k, v in held.items() if v[1] is not None}
    pick = min(burst, key=burst.get)
    best = min(sus, key=sus.get)
    gain = sus[pick] - sus[best]
    print(f"{ma[0]}x{mb[0]}: a{ma[0]} b{mb[0]} out{mo[0]} strides {ma[1]} {mb[1]} beta={beta}: "
          f"burst pick {pick} ({burst[pick]:.3f} ms), sustained: pick {sus[pick]:.3f} ms, best {best} {sus[best]:.3f} ms (gain {gain*1000:.1f} us)")
    if energy and pick in energy:
        least = min(energy, key=energy.get)
        print(f"   energy: pick {energy[pick]:.1f} mJ, least {least} {energy[least]:.1f} mJ "
              f"({100 * (1 - energy[least] / energy[pick]):.1f}% less)")
    print("   burst    ", " ".join(f"{k}:{v:.3f}" for k, v in burst.items()))
    print("   sustained", " ".join(f"{k}:{v:.3f}" for k, v in sus.items()))
    print("   mJ held  ", " ".join(f"{k}:{v:.1f}" for k, v in energy.items()))
