"""runtime/cuda/skinny_grads.py + csrc/kernels/skinny_grads.cu: both gradients of a
rank-wide NT matmul (LoRA's delta) from one pass over d_C.

On a GPU (`-m cuda`): for each rank the kernel covers (16 to 64) and a strided d_C,
d_A = alpha d_C B and d_B = alpha d_C^T A match an fp32 reference within bf16 rounding,
written into given targets, the same bits every call where the CTAs store their parts
(else through atomics into sums left zero); uncovered shapes and dtypes fall back (None),
and so does the atomics' path under torch's deterministic mode; the matmul's GPU backward
(train_kernels.matmul_grads) takes the kernel and agrees with the two-GEMM path it
replaces. Without a GPU: the CPU backward never reaches the kernel, and the partials give
way to the sums where they would take too much memory."""

from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch")

from runtime.cuda.skinny_grads import covers, skinny_nt_backward  # noqa: E402
from runtime.cuda.train_kernels import matmul_grads  # noqa: E402
from tests.dist_testing import needs_gpus  # noqa: E402


def test_cpu_backward_does_not_take_the_kernel():
    g = torch.Generator().manual_seed(0)
    d_C, A, B = (torch.randn(*s, generator=g) for s in ((256, 128), (256, 16), (128, 16)))
    assert not covers(d_C, A, B)
    d_A, d_B = matmul_grads(d_C, A, B, wanted=(True, True), transpose="NT", alpha=2.0)
    torch.testing.assert_close(d_A, 2.0 * d_C @ B)
    torch.testing.assert_close(d_B, 2.0 * d_C.t() @ A)


def _operands(T, N, R, pad=0, seed=0):
    torch.manual_seed(seed)
    d_C = torch.randn(T, N + pad, device="cuda", dtype=torch.bfloat16)[:, :N]
    A = torch.randn(T, R, device="cuda", dtype=torch.bfloat16)
    B = torch.randn(N, R, device="cuda", dtype=torch.bfloat16) * 0.1
    return d_C, A, B


def _check(got, expect):
    err = (got.float() - expect).abs().max() / expect.abs().max()
    assert err < 1e-2, f"relative error {err:.2e}"


@needs_gpus(1)
@pytest.mark.parametrize("R", [16, 32, 48, 64])
@pytest.mark.parametrize("T,N,pad", [(256, 128, 0), (512, 1152, 8), (2048, 6144, 0)])
def test_kernel_matches_reference(R, T, N, pad):
    d_C, A, B = _operands(T, N, R, pad, seed=R)
    alpha = 2.0
    targets = [torch.full((T, R), float("nan"), device="cuda", dtype=torch.bfloat16),
               torch.full((N, R), float("nan"), device="cuda", dtype=torch.bfloat16)]
    d_A, d_B = skinny_nt_backward(d_C, A, B, alpha, targets)
    assert d_A.data_ptr() == targets[0].data_ptr() and d_B.data_ptr() == targets[1].data_ptr()
    _check(d_A, alpha * d_C.float() @ B.float())
    _check(d_B, alpha * d_C.float().t() @ A.float())


def _calls_and_replays(d_C, A, B, blocks=None):
    """The gradients of a first call, of a second, and of three replays of a captured call
    (the kept workspace reused each time); with `blocks`, d_B stacked ([N, 16]: every
    element written)."""
    def call(out=None):
        return skinny_nt_backward(d_C, A, B, 2.0, out, blocks=blocks, compact=bool(blocks))

    first = [t.clone() for t in call()]
    again = [t.clone() for t in call()]
    graph, targets = torch.cuda.CUDAGraph(), [torch.empty_like(first[0]), None]
    with torch.cuda.graph(graph):
        targets[1] = call(targets)[1]
    replays = []
    for _ in range(3):
        for t in targets:
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        replays.append([t.clone() for t in targets])
    return first, again, replays


@needs_gpus(1)
@pytest.mark.parametrize("blocks", [None, [14336, 14336]])
def test_the_partials_give_the_same_bits_every_call(blocks):
    """Where the CTAs store their parts (no atomics): a second call and a captured graph's
    replays give the first call's bits, dense B or block-diagonal (d_B stacked), and they
    match the fp32 reference. The workspace starts as NaN: every part is written before
    the finishing launch reads it (so it is made with torch.empty, no fill captured)."""
    from runtime.cuda.skinny_grads import _work, block_ends

    d_C, A, B = _operands(2048, 28672, 32, seed=5)
    if blocks:
        B = _block_diagonal(blocks, seed=2).cuda()
    work, partials = _work(d_C.device, 2048, 28672, 32, block_ends(blocks, B))
    assert partials
    work.fill_(float("nan"))
    first, again, replays = _calls_and_replays(d_C, A, B, blocks)
    for got in [again] + replays:
        assert all(torch.equal(g, f) for g, f in zip(got, first))
    _check(first[0], 2.0 * d_C.float() @ B.float())
    d_B = 2.0 * d_C.float().t() @ A.float()
    if blocks:  # stacked: the first block's rows, its own 16 columns
        d_B = d_B[:14336, :16]
    _check(first[1][:d_B.shape[0]], d_B)


@needs_gpus(1)
def test_the_sums_are_left_zero_for_the_next_call(monkeypatch):
    """MODULEC_SKINNY_PARTIALS=0 (as where the partials would take too much memory): the
    CTAs add into fp32 sums through atomics and the finishing launch zeroes them as it
    casts them: calls one after another and a captured graph's replays give the first
    call's gradients again (to the atomics' order), the sums zero after each call; the
    partials' gradients agree with them."""
    from runtime.cuda.skinny_grads import _work

    d_C, A, B = _operands(2048, 28672, 32, seed=5)
    parted = skinny_nt_backward(d_C, A, B, 2.0)
    monkeypatch.setenv("MODULEC_SKINNY_PARTIALS", "0")
    work, partials = _work(d_C.device, 2048, 28672, 32, [])
    assert not partials and work.numel() == (2048 + 28672) * 32
    first, again, replays = _calls_and_replays(d_C, A, B)
    assert int(torch.count_nonzero(work)) == 0
    for got in [again, parted] + replays:
        for g, want in zip(got, first):
            _check(g, want.float())


def test_the_partials_give_way_to_the_sums_where_they_would_take_too_much(monkeypatch):
    """The partials' workspace grows with T; above PARTIALS_MAX_BYTES a problem keeps the
    sums instead (and then is not taken under torch's deterministic mode)."""
    import runtime.cuda.skinny_grads as skinny

    class Extension:
        @staticmethod
        def skinny_partial_floats(rows, cols, rank, blocks):
            return (rows // 256) * cols * (16 if blocks else rank) + rows * rank

    monkeypatch.setattr("runtime.cuda.build.load", lambda: Extension)
    monkeypatch.setattr(skinny, "_work_kept", {})
    monkeypatch.setattr(skinny.torch, "zeros", lambda size, **kw: torch.empty(size))
    monkeypatch.setattr(skinny.torch.cuda, "current_stream",
                        lambda device: type("S", (), {"cuda_stream": 0}))
    monkeypatch.setattr(skinny.torch.cuda, "device", lambda device: contextlib.nullcontext())
    device = torch.device("cpu")
    work, partials = skinny._work(device, 2048, 28672, 32, [])
    assert partials and work.numel() == Extension.skinny_partial_floats(2048, 28672, 32, [])
    work, partials = skinny._work(device, 32768, 28672, 32, [])  # 470 MB of partials
    assert not partials and work.numel() == (32768 + 28672) * 32
    torch.use_deterministic_algorithms(True)
    try:
        assert skinny._work(device, 32768, 28672, 32, []) == (None, False)
        assert skinny._work(device, 2048, 28672, 32, [])[1]
    finally:
        torch.use_deterministic_algorithms(False)


@needs_gpus(1)
def test_uncovered_calls_fall_back(monkeypatch):
    d_C, A, B = _operands(256, 128, 16)
    assert covers(d_C, A, B)
    assert skinny_nt_backward(d_C[:200], A[:200], B) is None  # T not a multiple of 256
    assert skinny_nt_backward(d_C[:, :96], A, B[:96]) is None  # N not a multiple of 128
    assert skinny_nt_backward(d_C, A[:, :8].contiguous(), B[:, :8].contiguous()) is None
    assert skinny_nt_backward(d_C.float(), A.float(), B.float()) is None
    monkeypatch.setenv("MODULEC_SKINNY_GRADS", "0")
    assert skinny_nt_backward(d_C, A, B) is None
    monkeypatch.delenv("MODULEC_SKINNY_GRADS")
    torch.use_deterministic_algorithms(True)
    try:
        assert skinny_nt_backward(d_C, A, B) is not None  # the partials: the same bits
        monkeypatch.setenv("MODULEC_SKINNY_PARTIALS", "0")
        assert skinny_nt_backward(d_C, A, B) is None  # the sums' atomics: not
    finally:
        torch.use_deterministic_algorithms(False)


@needs_gpus(1)
def test_matmul_backward_takes_the_kernel_and_agrees(monkeypatch):
    d_C, A, B = _operands(1024, 4096, 48, seed=3)
    d_C3, A3 = d_C.view(2, 512, 4096), A.view(2, 512, 48)  # folded leading dims
    fused = matmul_grads(d_C3, A3, B, wanted=(True, True), transpose="NT", alpha=2.0)
    monkeypatch.setenv("MODULEC_SKINNY_GRADS", "0")
    plain = matmul_grads(d_C3, A3, B, wanted=(True, True), transpose="NT", alpha=2.0)
    assert fused[0].shape == A3.shape and fused[1].shape == B.shape
    for f, p in zip(fused, plain):
        _check(f, p.float())


def _block_diagonal(rows, seed=0):
    """A block-diagonal B of 16-wide blocks with `rows` rows each, as block_diag lays it."""
    g = torch.Generator().manual_seed(seed)
    blocks = [(torch.randn(r, 16, generator=g) * 0.1).to(torch.bfloat16) for r in rows]
    return torch.block_diag(*blocks)


@pytest.mark.parametrize("rows,expect", [
    ([256, 128, 128], [256, 384, 512]),  # q/k/v's
    ([128, 128], [128, 256]),
    ([256], []),  # one block: dense
    ([256, 100, 156], []),  # an end off the 128-column chunks
    ([128] * 5, []),  # more blocks than the kernel takes
])
def test_block_ends_are_given_where_the_kernel_takes_them(rows, expect):
    from runtime.cuda.skinny_grads import block_ends

    assert block_ends(rows, _block_diagonal(rows)) == expect


def test_block_ends_switch_off(monkeypatch):
    from runtime.cuda.skinny_grads import block_ends

    monkeypatch.setenv("MODULEC_SKINNY_BLOCKS", "0")
    assert block_ends([128, 128], _block_diagonal([128, 128])) == []


def test_the_step_tells_the_fused_projections_gradients_their_blocks(monkeypatch):
    """In a LoRA step (rank 16: 16-wide blocks) the backward of each fused projection's
    delta (q/k/v: three blocks, gate/up: two) gets B's block rows (`b_blocks`, from the
    block_diag that made B); the other projections' get none."""
    import runtime.cuda.train_kernels as train_module
    from tests.test_lora_step import _arena_step, _lora_model

    seen, grads = [], train_module.matmul_grads

    def recorded(d_C, A, B, **attrs):
        if attrs.get("transpose") == "NT" and A.shape[-1] % 16 == 0:
            seen.append((tuple(B.shape), attrs.get("b_blocks")))
        return grads(d_C, A, B, **attrs)
    monkeypatch.setattr(train_module, "matmul_grads", recorded)
    model = _lora_model(rank=16)
    _arena_step(model, monkeypatch, True)
    q, k, v = (model.params[f"blocks[0].attention.qkv_weight.{p}.lora_B"].shape[0]
               for p in ("q", "k", "v"))
    up = model.params["blocks[0].mlp.up_weight.up.lora_B"].shape[0]
    blocked = {(shape, tuple(b)) for shape, b in seen if b}
    assert blocked == {((q + k + v, 48), (q, k, v)), ((2 * up, 32), (up, up))}
    assert any(b is None for _, b in seen)  # o and down: one adapter, B dense


@needs_gpus(1)
@pytest.mark.parametrize("rows", [[256, 128, 128], [1024, 1024], [128, 256, 128, 512]])
def test_block_diagonal_B_sums_each_block_alone(rows):
    """With B's blocks given, d_A = alpha d_C B matches the fp32 reference (each chunk of
    d_C against its own block), written into a view whose rows lie apart (d_t beside d_y
    in the one-GEMM d_x's scratch), and d_B's diagonal blocks match alpha d_C^T A there;
    the rest of d_B (discarded by block_diag's backward) is not written; the sums are
    left zero (a second call gives the same)."""
    T, N, R = 512, sum(rows), 16 * len(rows)
    d_C, A, _ = _operands(T, N, R, seed=len(rows))
    B = _block_diagonal(rows, seed=1).cuda()
    nan = dict(device="cuda", dtype=torch.bfloat16)
    wide = torch.full((T, 40 + R), float("nan"), **nan)
    d_B = torch.full((N, R), float("nan"), **nan)
    full = 2.0 * d_C.float().t() @ A.float()
    for _ in range(2):
        d_A, got_B = skinny_nt_backward(d_C, A, B, 2.0, [wide[:, 40:], d_B], blocks=rows)
        assert d_A.data_ptr() == wide[:, 40:].data_ptr() and got_B.data_ptr() == d_B.data_ptr()
        _check(d_A, 2.0 * d_C.float() @ B.float())
        assert wide[:, :40].isnan().all()
        start = 0
        for i, r in enumerate(rows):
            cols = slice(16 * i, 16 * i + 16)
            _check(d_B[start:start + r, cols], full[start:start + r, cols])
            off = d_B[start:start + r].clone()
            off[:, cols] = float("nan")
            assert off.isnan().all()
            start += r


def _covered_lora_step():
    """A LoRA model at a shape the one-pass kernel covers (T = 256, N multiples of 128;
    rank 16) with its weights laid on the GPU with side columns and tail rows: (model,
    the weight views, inputs, the slots to hold while it runs)."""
    import runtime.cuda.lora_kcat as kcat
    from modulec.lower.lora import is_adapter
    from runtime.cuda.state import region_of, stacked_order
    from runtime.model import Model
    from runtime_models import DENSE, TINY

    settings = DENSE | dict(d_model=128, d_ff=256, num_heads=4, num_kv_heads=2, max_seq=256)
    model = Model.from_module(TINY["llama"][0], settings=settings, dtype=torch.bfloat16,
                              lora=dict(rank=16, alpha=32, targets=["q", "k", "v", "o",
                                                                      "gate", "up", "down"]))
    model.init_random(1, std=0.05)
    for p, t in model.params.items():  # B != 0: the deltas mean something
        if p.endswith("lora_B"):
            t.copy_(0.05 * torch.randn(t.shape))
    inputs = {"token_ids": torch.randint(0, 64, (1, 256), dtype=torch.int32)}
    shapes = {p: tuple(t.shape) for p, t in model.params.items()}
    frozen = {p for p in shapes if not is_adapter(p)}
    sides, tails = kcat.side_columns(shapes, frozen), kcat.tail_rows(shapes, frozen)
    order = stacked_order(model.source.program_for(inputs).graph, sorted(shapes))
    _, (views,) = region_of(shapes, [(torch.bfloat16, order)], device="cuda", sides=sides,
                            tails=tails)
    for path, view in views.items():
        view.copy_(model.params[path])
    held = (kcat.lay_sides(views, sides), kcat.lay_tails(views, tails))
    return model, views, inputs, held


@needs_gpus(1)
def test_the_one_gemm_d_x_takes_d_t_where_the_kernel_wrote_it(monkeypatch):
    """A LoRA step at a shape the one-pass kernel covers (weights laid with side columns
    and tail rows): each one-GEMM pair's d_t is written by the kernel's finishing launch
    straight into the [d_y | d_t] scratch, so nothing is copied there, and the step
    computes what the two-GEMM step does."""
    import runtime.cuda.lora_kcat as kcat
    from tests.test_lora_step import _arena_step, _error

    model, views, inputs, held = _covered_lora_step()  # noqa: F841 (held: the slots)
    into_scratch, copy_rows = [], kcat._copy_rows

    def counted(into, rows):  # the rows that move into a d_x scratch
        scratches = [t for key, t in kcat._scratch.items() if key[-1] == "dx"]
        moved = (into.data_ptr(), into.stride()) != (rows.data_ptr(), rows.stride())
        if moved and any(into.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
                         for t in scratches):
            into_scratch.append(tuple(into.shape))
        copy_rows(into, rows)
    monkeypatch.setattr(kcat, "_copy_rows", counted)
    outputs, grads, run, _ = _arena_step(model, monkeypatch, True, "cuda", params=views,
                                         inputs=inputs)
    assert run.lora_dx_one_gemm == 6
    # no d_t, and no d_y either: down's, the residual gradient, is written there by the
    # norms' backward (runtime/cuda/residual_rows.py)
    assert into_scratch == []
    two_outputs, two_grads, _, _ = _arena_step(model, monkeypatch, True, "cuda",
                                               inputs=inputs)
    errors = [_error(a, b) for a, b in zip(outputs, two_outputs)] + \
        [_error(grads[p], two_grads[p]) for p in two_grads]
    assert max(errors) < 0.05, errors


@needs_gpus(1)
@pytest.mark.parametrize("rows", [[256, 128, 128], [1024, 1024]])
def test_the_blocks_gradients_come_back_stacked(rows):
    """`compact`: d_B comes back [N, 16], each row its own block's columns (the blocks'
    gradients stacked, runtime/cuda/stacked_blocks.py), matching the diagonal blocks the
    dense d_B holds; a planned target for d_B is left unwritten."""
    T, N, R = 512, sum(rows), 16 * len(rows)
    d_C, A, _ = _operands(T, N, R, seed=len(rows))
    B = _block_diagonal(rows, seed=1).cuda()
    planned = torch.full((N, R), float("nan"), device="cuda", dtype=torch.bfloat16)
    d_A, stacked = skinny_nt_backward(d_C, A, B, 2.0, [None, planned], blocks=rows,
                                      compact=True)
    assert tuple(stacked.shape) == (N, 16) and planned.isnan().all()
    full = 2.0 * d_C.float().t() @ A.float()
    _check(d_A, 2.0 * d_C.float() @ B.float())
    start = 0
    for i, r in enumerate(rows):
        _check(stacked[start:start + r], full[start:start + r, 16 * i:16 * i + 16])
        start += r
    _, dense = skinny_nt_backward(d_C, A, B, 2.0, blocks=rows, compact=False)
    assert tuple(dense.shape) == (N, R)


def test_the_fused_projections_d_B_goes_to_block_diags_backward_alone(monkeypatch):
    """In a LoRA program each block_diag backward (q/k/v's B, gate/up's) reads the d_B of
    its delta's matmul backward alone and makes parameter gradients only, so that d_B may
    come back stacked (`stacked_blocks.reader`); MODULEC_STACKED_BLOCK_GRADS=0 asks none."""
    from runtime.cuda import stacked_blocks
    from tests.test_lora_step import _lora_model

    model = _lora_model(rank=16)
    inputs = {"token_ids": torch.randint(0, 64, (1, 16), dtype=torch.int32)}
    graph = model.source.program_for(inputs).graph

    def found():
        return {(f.name, stacked_blocks.reader(f, n).id) for f in graph.functions
                if f.gradient_of for n in f.nodes
                if n.kind == "op" and n.target == "matmul_backward"
                and stacked_blocks.reader(f, n) is not None}
    block_grads = {(f.name, n.id) for f in graph.functions if f.gradient_of
                   for n in f.nodes if n.kind == "op" and n.target == "block_diag_backward"}
    assert len(block_grads) == 2 and found() == block_grads
    monkeypatch.setenv("MODULEC_STACKED_BLOCK_GRADS", "0")
    assert found() == set()
    views = stacked_blocks.parts(torch.arange(12.0).reshape(6, 2), [4, 2])
    assert [v.tolist() for v in views] == [[[0, 1], [2, 3], [4, 5], [6, 7]], [[8, 9], [10, 11]]]


@needs_gpus(1)
def test_the_step_hands_the_blocks_their_stacked_gradients(monkeypatch):
    """The LoRA step at a covered shape: a fused projection's d_B whose blocks the kernel
    sums alone comes back stacked and block_diag's backward is given its rows (no
    launch); the step computes what it does with block_diag's backward run
    (MODULEC_STACKED_BLOCK_GRADS=0)."""
    from tests.test_lora_step import _arena_step, _error

    model, views, inputs, held = _covered_lora_step()  # noqa: F841 (held: the slots)
    # gate/up's d_B from the usual path: where quack imports, the gated GEMMs would take
    # it, interleaved and summed dense (runtime/cuda/gated_mlp.py); `_arena_step` undoes
    # the monkeypatch, so each run sets it
    monkeypatch.setenv("MODULEC_GATED_GEMM", "0")
    outputs, grads, run, _ = _arena_step(model, monkeypatch, True, "cuda", params=views,
                                         inputs=inputs)
    layers = {p.split(".")[0] for p in model.params if p.startswith("blocks[")}
    # gate/up's each layer ([256, 256]); q/k/v's blocks (128, 64, 64 rows) do not end on
    # the kernel's 128-column chunks, so its B is summed dense and block_diag's backward runs
    assert run.stacked_block_grads == len(layers)
    monkeypatch.setenv("MODULEC_STACKED_BLOCK_GRADS", "0")
    monkeypatch.setenv("MODULEC_GATED_GEMM", "0")
    off_outputs, off_grads, off_run, _ = _arena_step(model, monkeypatch, True, "cuda",
                                                     params=views, inputs=inputs)
    assert off_run.stacked_block_grads == 0
    errors = [_error(a, b) for a, b in zip(outputs, off_outputs)] + \
        [_error(grads[p], off_grads[p]) for p in off_grads]
    assert max(errors) < 0.02, errors


def _emulated_skinny(d_C, A, B, alpha=1.0, out=None, blocks=None, compact=False):
    """skinny_nt_backward's results on the CPU (torch products): d_B stacked [N, 16] where
    `compact` and B's blocks are given, as the kernel's finishing launch writes it."""
    d_a, d_b = alpha * d_C @ B, alpha * d_C.t() @ A
    if not (compact and blocks):
        return [d_a, d_b]
    rows = [sum(blocks[:i]) for i in range(len(blocks) + 1)]
    return [d_a, torch.cat([d_b[rows[i]:rows[i + 1], 16 * i:16 * i + 16]
                            for i in range(len(blocks))])]


def test_the_cpu_step_hands_the_blocks_their_stacked_gradients(monkeypatch):
    """The interpreter's side of the stacked block gradients, on the CPU arena step with
    the one-pass kernel's results emulated (`_emulated_skinny`): each fused projection's
    matmul backward asks for d_B stacked, block_diag's backward hands out its rows (q/k/v's
    and gate/up's each layer), and every output and gradient is the bits of the step that
    runs block_diag's backward (MODULEC_STACKED_BLOCK_GRADS=0)."""
    import runtime.cuda.skinny_grads as skinny
    from tests.test_lora_step import _arena_step, _lora_model

    model = _lora_model(rank=16)
    runs = {}
    for on in ("1", "0"):
        monkeypatch.setenv("MODULEC_STACKED_BLOCK_GRADS", on)
        monkeypatch.setattr(skinny, "skinny_nt_backward", _emulated_skinny)
        runs[on] = _arena_step(model, monkeypatch, True)  # undoes the patches
    layers = {p.split(".")[0] for p in model.params if p.startswith("blocks[")}
    assert runs["1"][2].stacked_block_grads == 2 * len(layers)
    assert runs["0"][2].stacked_block_grads == 0
    for one, two in zip(runs["1"][0], runs["0"][0]):
        assert torch.equal(one, two)
    grads, off = runs["1"][1], runs["0"][1]
    assert set(grads) == set(off) and all(torch.equal(grads[p], off[p]) for p in off)
