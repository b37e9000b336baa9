"""Which of the GPU step's ops launch which kernels, and how many: every op the step's
interpreter dispatches runs inside `record_function("op:<f|b>:<target>")`, one eager step
runs under torch.profiler, and each kernel is counted under the op that launched it
(kernels launched by torch ops outside any op, the optimizer's among them, under
"(outside) <aten op>"; the extension's own kernels, which no aten op launches, are not
listed). A step replayed as one CUDA graph pays a few microseconds per kernel besides its
run time, so this is where a step's launch count comes from.

    python3 benchmarks/gpu/op_kernels.py --shape llama3-8b --lora --batch 1 --layers 4
    python3 benchmarks/gpu/op_kernels.py --layers 4          # TinyLlama, B=4, T=2048

Per-layer counts are the totals over --layers (fewer layers than the model: a quicker run,
the same counts a layer). Results: benchmarks/gpu/results-h100-op-kernels-*.txt."""
import argparse, collections, sys
from pathlib import Path
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT)); sys.path.insert(0, str(ROOT / "benchmarks"))
import torch
from torch.profiler import ProfilerActivity, profile, record_function
import runtime.interpreter as interp
from runtime.cuda.step import TrainStep, AdamWConfig
from train_step import tiny_llama

p = argparse.ArgumentParser()
p.add_argument("--shape", default="tinyllama"); p.add_argument("--lora", action="store_true")
p.add_argument("--layers", type=int, default=4); p.add_argument("--batch", type=int, default=4)
p.add_argument("--seq", type=int, default=2048)
a = p.parse_args()
shape = tiny_llama(a.layers) if a.shape == "tinyllama" else dict(
    vocab_size=128256, d_model=4096, n_layers=a.layers, num_heads=32, num_kv_heads=8,
    d_ff=14336, max_seq=8192, eps=1e-5, rope_theta=500000.0)
lora = dict(rank=16, alpha=32, targets=["q", "k", "v", "o", "gate", "up", "down"]) if a.lora else None
step = TrainStep.from_module(ROOT / "std/models/llama.module", shape, lora=lora,
                             adamw=AdamWConfig(), batch=a.batch, seq=a.seq).init_random()
tokens = torch.randint(0, shape["vocab_size"], (a.batch, a.seq), dtype=torch.int32, device="cuda")
dispatch = interp.Interpreter._dispatch
def wrapped(self, node, frame, forward):
    if node.kind != "op":
        return dispatch(self, node, frame, forward)
    phase = "b" if frame.function.gradient_of else "f"
    with record_function(f"op:{phase}:{node.target}"):
        return dispatch(self, node, frame, forward)
interp.Interpreter._dispatch = wrapped
for _ in range(2):
    step(tokens)
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    step(tokens)
    torch.cuda.synchronize()
count, time_ = collections.Counter(), collections.Counter()
kinds = collections.defaultdict(collections.Counter)
for ev in prof.events():
    if not ev.kernels:
        continue
    owner, up = "(outside ops)", ev
    while up is not None:
        if up.name.startswith("op:"):
            owner = up.name; break
        up = up.cpu_parent
    if owner == "(outside ops)":
        up = ev; chain = []
        while up is not None:
            chain.append(up.name); up = up.cpu_parent
        owner = "(outside) " + " < ".join(chain[:3])[:110]
    for k in ev.kernels:
        count[owner] += 1; time_[owner] += k.duration
        kinds[owner][k.name[:60]] += 1
total = sum(count.values())
print(f"kernels in one eager step: {total}, {a.layers} layers, lora={bool(lora)}")
for owner, n in count.most_common(60):
    print(f"{n:6d} {time_[owner]/1e3:9.2f} ms  {owner}")
    for kname, kn in kinds[owner].most_common(4):
        print(f"           {kn:5d}  {kname}")
