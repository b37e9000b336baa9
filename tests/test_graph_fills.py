"""The captured step's memset nodes as fill kernel nodes (runtime/cuda/graph_nodes.py,
csrc/kernels/graph_fills.cu): off the switch or on a plain graph nothing changes; on the GPU
a captured LoRA step replaces its memset nodes and computes what the step with them does."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from runtime.cuda import graph_nodes  # noqa: E402
from tests.dist_testing import needs_gpus  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHAPE = dict(vocab_size=1024, d_model=512, n_layers=2, num_heads=8, num_kv_heads=2,
             d_ff=1408, max_seq=512)


def test_the_switch_and_a_plain_graph(monkeypatch):
    monkeypatch.setenv("MODULEC_GRAPH_FILLS", "0")
    assert not graph_nodes.enabled()
    monkeypatch.delenv("MODULEC_GRAPH_FILLS")
    assert graph_nodes.enabled()

    class Plain:  # what torch.cuda.CUDAGraph() gives: instantiated at capture_end
        pass
    assert graph_nodes.finish(Plain()) == 0


def _captured_lora_losses(monkeypatch, fills: str, tokens, replays: int = 3):
    from runtime.cuda.step import TrainStep

    monkeypatch.setenv("MODULEC_GRAPH_FILLS", fills)
    step = TrainStep.from_module(ROOT / "std/models/llama.module", SHAPE, batch=1, seq=512,
                                 lora=dict(rank=16, alpha=32, targets=["q", "k", "v", "o",
                                                                       "gate", "up", "down"]))
    step.init_random(0)
    step.adamw.lr = 1e-3
    step.set_batch(tokens)
    step.capture(warmup=1)
    return [float(step(tokens)) for _ in range(replays)], step.graph_fills


@needs_gpus(1)
def test_a_captured_lora_step_with_fill_kernels_computes_what_memsets_did(monkeypatch):
    """cuBLAS's split-K GEMMs of the adapters zero workspace before they run: captured, those
    are memset nodes, here fill kernel nodes; the losses of replays (each an update) agree
    with the graph that kept its memset nodes (to the skinny kernels' atomics' rounding)."""
    tokens = torch.randint(0, SHAPE["vocab_size"], (1, 512),
                           generator=torch.Generator().manual_seed(0)).to(torch.int32).cuda()
    kept, none = _captured_lora_losses(monkeypatch, "0", tokens)
    filled, replaced = _captured_lora_losses(monkeypatch, "1", tokens)
    assert none == 0 and replaced > 0
    assert not hasattr(graph_nodes.new_graph(fills=False), "_modulec_kept")  # data parallel
    for a, b in zip(kept, filled):
        assert abs(a - b) <= 1e-3 * abs(a), (kept, filled)
    assert filled[-1] < filled[0]
