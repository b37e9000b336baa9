"""`@kernel(name)` (spec §7.5.3): names checked against the kernels of the annotated op
(modulec/ops/kernel_names.py), carried to the forward and the derived backward node, and
selected by the runtime where the registry has the kernel (runtime/kernel_choice.py)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from modulec.ir.graph import Node  # noqa: E402
from modulec.ops.kernel_names import GPU_VARIANTS, REFERENCE, kernel_names  # noqa: E402
from runtime.errors import RuntimeUserError  # noqa: E402
from runtime.kernel_choice import requested, select, variants  # noqa: E402
from runtime.kernels import KERNELS  # noqa: E402
from runtime.model import Model  # noqa: E402
from tests.test_cli import run as run_cli  # noqa: E402

PROGRAM = """\
model Proj(d: int = 4):
  params:
    w: [d, d]
  forward:
    in: x: [B, d]
    out: y: [B, d]
    graph:
      x -> matmul(w, transpose=NT) {op} -> h {flow}
      (h, x) -> mul() -> y
"""


def _node(*args: str) -> Node:
    return Node("n0", "op", "flash_attention", (), (), (), (("kernel", args),))


def _write(tmp_path, op="", flow=""):
    path = tmp_path / "m.module"
    path.write_text(PROGRAM.format(op=op, flow=flow), encoding="utf-8")
    return path


def test_the_compiler_names_the_kernels_the_gpu_registry_has():
    from runtime.cuda.train_kernels import train_kernels

    registry = train_kernels(device="cpu")
    for op in KERNELS:
        assert variants(registry, op) == sorted(kernel_names(op)["gpu"],
                                                key=lambda n: (n != REFERENCE, n)), op
    assert set(GPU_VARIANTS) <= set(KERNELS)


def test_select_takes_the_named_kernel_the_reference_or_the_default():
    registry = {"flash_attention": "default", "flash_attention@cudnn": "cudnn kernel"}
    assert requested(_node('"cudnn"', "fallback=false")) == ("cudnn", False)
    assert select(registry, "flash_attention", _node('"cudnn"'), "default") == "cudnn kernel"
    assert select(registry, "flash_attention", _node('"reference"'), "default") is \
        KERNELS["flash_attention"]
    assert select(registry, "flash_attention", _node('"flash"'), "default") == "default"
    plain = Node("n0", "op", "flash_attention", (), ())
    assert select(registry, "flash_attention", plain, "default") == "default"


def test_a_missing_kernel_without_fallback_is_an_error_naming_the_available_ones():
    registry = {"flash_attention": "default", "flash_attention@cudnn": "cudnn kernel"}
    with pytest.raises(RuntimeUserError, match=r"no kernel `flash` for `flash_attention`; "
                                               r"its kernels for it: reference, cudnn"):
        select(registry, "flash_attention", _node('"flash"', "fallback=false"), "default")


def test_an_attention_kernel_that_does_not_cover_a_call_falls_back_to_the_steps_or_errs():
    """`@kernel("fa4")` where FA4 cannot run (here: CPU tensors, no flash-attn-4) runs the
    step's own attention entry (which falls to the reference here); with fallback=false the
    call is an error naming the kernel, not a silent reference run."""
    from runtime.cuda.train_kernels import train_kernels

    registry = train_kernels(device="cpu")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 16, generator=g) for _ in range(3))
    attrs = {"causal": True}
    want = KERNELS["flash_attention"].forward([q, k, v, None], attrs)
    for name in ("fa4", "fa4_bwd", "cudnn"):
        loose = select(registry, "flash_attention", _node(f'"{name}"'), "default")
        assert all(torch.equal(a, b) for a, b in zip(loose.forward([q, k, v, None], attrs),
                                                       want))
        strict = select(registry, "flash_attention", _node(f'"{name}"', "fallback=false"),
                        "default")
        with pytest.raises(RuntimeUserError, match=f"{name} does not cover"):
            strict.forward([q, k, v, None], attrs)


def test_the_attention_entry_records_what_ran_for_the_trainers_note():
    """The entry records (direction, kernel, head dim) of each eager call; `modulec train`
    prints them after its first step, with the flash-attn-4 hint where cuDNN ran a head
    dim 64 backward and the package is missing."""
    from runtime.cuda.attention import FA4, ran_note
    from runtime.cuda.train_kernels import train_kernels

    entry = train_kernels(device="cpu")["flash_attention"]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 16, generator=g) for _ in range(3))
    out, lse = entry.forward([q, k, v, None], {"causal": True})
    entry.backward([torch.ones_like(out), q, k, v, out, lse, None], {"causal": True})
    assert entry.ran == {("forward", "reference", 16), ("backward", "reference", 16)}
    assert ran_note(entry.ran) == ("attention: forward the reference kernel; backward the "
                                   "reference kernel")
    gpu_like = {("forward", "cudnn", 64), ("backward", "cudnn", 64)}
    hint = 'pip install "modulec[fa4]"'
    assert (hint in ran_note(gpu_like)) == (not FA4.interface())
    if not FA4.interface():  # what installing it changes (no measured figure: it goes stale)
        assert ran_note(gpu_like).endswith("backward then runs FlashAttention-4's kernel "
                                           "instead of cuDNN's on SM90 / SM100 cards)")
    assert ran_note({("forward", "cudnn", 64), ("backward", "fa4", 64)}).startswith(
        "attention: forward cuDNN; backward FlashAttention-4")
    assert ran_note(set()) is None


@pytest.mark.parametrize("where", ["op", "flow"])
def test_the_choice_reaches_the_forward_and_the_derived_backward_node(tmp_path, where):
    path = _write(tmp_path, **{where: '@kernel("reference")'})
    graph = Model.from_module(path, dtype=torch.float64).source.program(planned=False).graph
    marked = [n for f in graph.functions for n in f.nodes
              if ("kernel", ('"reference"',)) in n.annotations]
    assert sorted(n.target for n in marked) == ["matmul", "matmul_backward"]


def test_the_runtime_runs_the_chosen_kernel(tmp_path, monkeypatch):
    calls = []
    reference = KERNELS["matmul"]

    class Counting:
        def __getattr__(self, attr):
            return getattr(reference, attr)

        def forward(self, inputs, attrs):
            calls.append("forward")
            return reference.forward(inputs, attrs)

    model = Model.from_module(_write(tmp_path, op='@kernel("reference")'),
                              dtype=torch.float64).init_random(0)
    monkeypatch.setitem(KERNELS, "matmul", Counting())  # what `reference` selects
    model.forward(x=torch.ones(2, 4, dtype=torch.float64))
    assert calls == ["forward"]


def test_a_kernel_missing_without_fallback_stops_the_run(tmp_path):
    """`flash` is a GPU kernel: the CPU reference runtime has none, and `fallback=false`
    asks for an error rather than the reference kernel."""
    path = tmp_path / "a.module"
    path.write_text(
        "model A(H: int = 2, D: int = 4):\n  forward:\n"
        "    in: (q: [B, H, T, D], k: [B, H, T, D], v: [B, H, T, D])\n"
        "    out: o: [B, H, T, D]\n    graph:\n"
        '      (q, k, v) -> flash_attention() @kernel("flash", fallback=false) -> (o, _)\n')
    assert run_cli("check", path).exit_code == 0
    q = torch.ones(1, 2, 3, 4, dtype=torch.float64)
    model = Model.from_module(path, dtype=torch.float64)
    with pytest.raises(RuntimeUserError, match="no kernel `flash` for `flash_attention`"):
        model.forward(q=q, k=q, v=q)
