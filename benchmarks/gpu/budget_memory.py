"""Where a budgeted step's memory goes (issue 6): one eager step of the TinyLlama shape,
unbudgeted and at a budget, printing memory allocated after the forward and the step's
peak, and for the budgeted one which released values still share storage with a value
the forward kept (so releasing them frees nothing).

    python benchmarks/gpu/budget_memory.py [budget GiB ...]
"""
import sys
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.train_step import tiny_llama  # noqa: E402
from runtime.cuda.step import TrainStep  # noqa: E402

GiB = 2**30


def frames(root):
    stack = [root]
    while stack:
        f = stack.pop()
        stack += f.children.values()
        yield f


def main(budgets):
    for budget in [None] + budgets:
        options = {} if budget is None else {"memory_budget": int(budget * GiB)}
        step = TrainStep.from_module(ROOT / "std/models/llama.module", tiny_llama(22), batch=4,
                                     seq=2048, derive_written=True, **options).init_random()
        step.set_batch(torch.randint(0, 32000, (4, 2048), dtype=torch.int32, device="cuda"))
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        released = []
        if step.decisions is not None:
            original = step.decisions._release

            def spy(frame, value, kind, sinks):
                t = original(frame, value, kind, sinks)
                released.append((frame.function.name, value, t))  # kept alive: diagnosis only
                return t
            step.decisions._release = spy
        run = step.interpreter()
        (out,), frame = run.forward([step.tokens])
        torch.cuda.synchronize()
        after = torch.cuda.memory_allocated()
        shared = Counter()
        if released:
            live = {}
            for f in frames(frame):
                for v, t in f.env.items():
                    if isinstance(t, torch.Tensor) and t.numel() > 1 and any(t.stride()):
                        live.setdefault(t.untyped_storage().data_ptr(), set()).add(
                            (f.function.name, v))
            for name, value, t in released:
                owners = live.get(t.untyped_storage().data_ptr())
                if owners:
                    shared[(name, value, tuple(sorted(owners))[:2],
                            t.untyped_storage().nbytes() >> 20)] += 1
            released_bytes = sum(t.untyped_storage().nbytes() for _, _, t in released)
        if step.decisions is not None:
            step.decisions._release = original
        del released, out, frame, run
        torch.cuda.synchronize()
        peak_fwd = torch.cuda.max_memory_allocated()
        print(f"budget {budget}: fixed {base / GiB:.2f} GiB, after forward (released kept "
              f"alive for the check) {after / GiB:.2f}, forward peak {peak_fwd / GiB:.2f}")
        if budget is not None:
            print(f"  released {released_bytes / GiB:.2f} GiB of storages; still shared with "
                  f"kept values: {len(shared)} kinds")
            for key, n in shared.most_common(12):
                print("   ", n, key)
        torch.cuda.reset_peak_memory_stats()
        step.loss_and_gradients()
        torch.cuda.synchronize()
        print(f"  eager step peak {torch.cuda.max_memory_allocated() / GiB:.2f} GiB")
        del step
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main([float(b) for b in sys.argv[1:]] or [18.3])
