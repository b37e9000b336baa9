"""A LoRA'd SwiGLU MLP with the activation in its GEMMs' epilogues (the GPU step's
interpreter, runtime/cuda/step_interpreter.py; the GEMMs: runtime/cuda/gated_gemm.py).

The step runs SwiGLU's gate/up projection as one GEMM over [x | t] and [W | s B]
(lora_kcat.py), splits gu and runs our swiglu kernel; backward, down's d_x GEMM, then
swiglu's backward, then gate/up's d_x GEMM. A gated GEMM applies the activation in the
epilogue instead: one kernel fewer each way and gu / d_h never read back. Its epilogue
pairs adjacent output columns, so gu and d_gu are interleaved (g0, u0, g1, u1, ...) where
the program's gate_up is [gate | up] (std/modules/mlp.module). Inside this path alone:

- forward (`run_forward`, at gate_up's add): the gated GEMM writes the interleaved gu into
  gate_up's planned bytes and h into hidden's (its rows laid wide, [h | t]); gate and up
  are gu's column-stride-2 views (what the backward saves), split and swiglu do not run;
- backward, down's d_x (`run_down_dx`): the gated GEMM over [d_y | d_t] and [W ; A] reads
  gu in its epilogue and writes d_gu, interleaved, where gate/up's d_x reads it (its
  one-GEMM scratch, lora_kcat.py); swiglu_backward and split_backward do not run. The
  epilogue also stores silu(g) * u, written over hidden's bytes, which nothing reads
  after down's d_x;
- gate/up's delta gradients (`run_delta_grads`): B's rows interleaved as d_gu's columns
  (a 0.9 MB gather at LoRA 8B), summed dense (B's zero blocks too), d_B's rows put back;
- gate/up's d_x (`run_gate_up_dx`): d_gu W with W's rows read interleaved in place, then
  d_t A added (the one GEMM's K = 2 d_ff + k r cannot mix the two orders).

Where a condition fails (no provider, hooks, a profiler, a replay, planner decisions on
these values, no side or tail slots) the step runs its usual path, which W laid as it is
keeps right. `sites` / `backward_sites` find the pattern in the IR; the runs check the
tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from modulec.plan.in_place import readers_of
from runtime.cuda.gated_gemm import deinterleaved, interleaved, provider
from runtime.cuda.kernels import typed
from runtime.decisions import APPLY_SAVED, RECOMPUTE, SWAP
from runtime.interpreter import static_shape

DROPPED = (RECOMPUTE, SWAP, APPLY_SAVED)


@dataclass(frozen=True)
class ForwardSite:
    add: object  # the add making gate_up (a one-GEMM pair: LoraPairs.bases)
    split: object  # gate_up -> gate, up (halves of the last dim)
    swiglu: object  # (gate, up) -> hidden


@dataclass(frozen=True)
class BackwardSite:
    down: object  # down's DxPair: its add's d_hidden feeds swiglu_backward alone
    swiglu_backward: object
    split_backward: object  # (d_gate, d_up) -> d_gate_up
    gate_up: object  # gate/up's DxPair, whose d_y is d_gate_up
    delta_grads: object  # the matmul_backward of gate/up's delta (d_t, d_B)


def _readers(functions) -> dict[str, list]:
    """value -> the ids of the nodes of `functions` reading it (modulec.plan.in_place)."""
    found: dict = {}
    for function in functions:
        for value, ids in readers_of(function).items():
            found.setdefault(value, []).extend(ids)
    return found


def _halves(function, split) -> bool:
    shape = static_shape(function, split.inputs[0])
    sizes = split.attr("sizes") or ()
    dim = int(split.attr("dim") if split.attr("dim") is not None else -1)
    return shape is not None and len(sizes) == 2 and sizes[0] == sizes[1] \
        and dim in (-1, len(shape) - 1) and 2 * int(sizes[0]) == int(shape[-1])


def sites(graph, function, pairs) -> dict[str, ForwardSite]:
    """{gate_up's add id: site} in forward `function`: a one-GEMM LoRA add whose output is
    read by a split alone, halves read by a swiglu alone, and in the backward by
    swiglu_backward alone (gate_up itself not at all)."""
    backward = [f for f in graph.functions if f.gradient_of == function.name]
    readers, later = _readers([function]), _readers(backward)
    by_id = {n.id: n for n in function.nodes}
    later_nodes = {n.id: n for f in backward for n in f.nodes}
    producers = {o: n for n in function.nodes for o in n.outputs if o}
    found = {}
    for split in function.nodes:
        if split.target != "split" or len(split.outputs) != 2 or not all(split.outputs):
            continue
        gu, (gate, up) = split.inputs[0], split.outputs
        add = producers.get(gu)
        users = readers.get(gate, []) + readers.get(up, [])
        if add is None or add.id not in pairs.bases or readers.get(gu) != [split.id] \
                or len(users) != 2 or users[0] != users[1] or later.get(gu) \
                or any(v in function.outputs for v in (gu, gate, up)):
            continue
        swiglu = by_id[users[0]]
        saved_by = [later_nodes[i] for i in later.get(gate, []) + later.get(up, [])]
        if swiglu.target != "swiglu" or tuple(swiglu.inputs) != (gate, up) \
                or not _halves(function, split) or any(
                    n.target != "swiglu_backward" or tuple(n.inputs[1:3]) != (gate, up)
                    for n in saved_by):
            continue
        found[add.id] = ForwardSite(add, split, swiglu)
    return found


def backward_sites(function, dx_pairs) -> dict[str, BackwardSite]:
    """{node id: site} for down's add, swiglu_backward, split_backward, gate/up's delta
    gradients and gate/up's add of backward `function`: down's d_x sum read by a
    swiglu_backward alone (its y unwanted), its two gradients by a split_backward alone,
    whose d_gate_up is read by gate/up's pair (a one-GEMM candidate) alone; and hidden
    read after down's add by nothing but down's deferred d_x GEMM."""
    readers = readers_of(function)
    producers = {o: n for n in function.nodes for o in n.outputs if o}
    by_id = {n.id: n for n in function.nodes}
    index = {n.id: i for i, n in enumerate(function.nodes)}
    found = {}
    for sb in function.nodes:
        if sb.target != "swiglu_backward" or len(sb.outputs) < 2 or not all(sb.outputs[:2]) \
                or any(sb.outputs[2:]):
            continue
        add = producers.get(sb.inputs[0])
        down = dx_pairs.adds.get(add.id) if add is not None else None
        d_gate, d_up = sb.outputs[:2]
        join = by_id.get(readers.get(d_gate, [""])[0])
        if down is None or readers.get(sb.inputs[0]) != [sb.id] or join is None \
                or join.target != "split_backward" or tuple(join.inputs) != (d_gate, d_up) \
                or readers.get(d_gate) != [join.id] or readers.get(d_up) != [join.id]:
            continue
        d_gu = join.outputs[0]
        gate_up = next((p for p in dx_pairs.adds.values() if p.base.inputs[0] == d_gu), None)
        users = readers.get(d_gu, [])
        maker = next((by_id[i] for i in users if gate_up is not None
                      and i != gate_up.base.id), None)
        hidden = down.base.inputs[1]
        if gate_up is None or maker is None or len(users) != 2 \
                or maker.target != "matmul_backward" or maker.attr("transpose") != "NT" \
                or maker.outputs[0] != gate_up.first.inputs[0] \
                or any(index[i] > index[add.id] for i in readers.get(hidden, [])
                       if i != down.base.id):
            continue
        site = BackwardSite(down, sb, join, gate_up, maker)
        for node in (add, sb, join, maker, gate_up.add):
            found[node.id] = site
    return found


def _usable(run, frame, values) -> bool:
    """Nothing watches the run, and the planner neither drops, swaps nor re-applies
    `values` of this run (a replay would run split / swiglu over gu's interleaved bytes)."""
    if run.arena is None or run.fp8_run is not None or not run._plain():
        return False
    return run.decisions is None or not any(
        run.decisions.of(frame.function.name, v, frame.instance) in DROPPED for v in values)


def _planned(run, frame, node, value: str, cols: int, dtype) -> torch.Tensor | None:
    """`value`'s planned bytes as [rows, cols] (kernels.typed: rows apart where the plan
    laid them wide), or None where it has none."""
    shape = static_shape(frame.function, value)
    raw = run.arena.out_bytes(frame, node, value) if shape is not None else None
    tensor = typed([raw], 0, shape, dtype) if raw is not None else None
    return None if tensor is None or tensor.shape[-1] != cols else tensor.view(-1, cols)


def run_forward(run, site: ForwardSite, source, matmul, frame, forward) -> bool:
    """gate_up (interleaved) and hidden from one gated GEMM (module docstring); True where
    it ran, False (nothing done) where a condition fails."""
    from runtime.cuda.lora_kcat import kcat_operands
    from runtime.cuda.train_kernels import overlaps

    node, function = site.add, frame.function
    gu_value, (gate, up), hidden = node.outputs[0], site.split.outputs, site.swiglu.outputs[0]
    if not _usable(run, frame, (gu_value, gate, up, hidden)) \
            or {site.split.id, site.swiglu.id} & run._replayed(function):
        return False
    attrs = run._attrs(source)
    x, w, t, b = (run._read(v, frame, forward) for v in (*source.inputs, *matmul.inputs))
    if not all(isinstance(v, torch.Tensor) for v in (x, w, t, b)) or w.dim() != 2 \
            or attrs.get("transpose") != "NT" or float(attrs.get("alpha", 1.0)) != 1.0:
        return False
    prov = provider(w.device)
    shape = static_shape(function, gu_value)
    if prov is None or shape is None:
        return False
    rows, ffn = x.numel() // x.shape[-1], w.shape[0] // 2
    gu = _planned(run, frame, node, gu_value, 2 * ffn, w.dtype)
    h = _planned(run, frame, site.swiglu, hidden, ffn, w.dtype)
    if gu is None or h is None or gu.shape[0] != rows or overlaps(gu, h) \
            or any(overlaps(v, o) for v in (x, w, t, b) for o in (gu, h)):
        return False
    operands = kcat_operands(x.reshape(rows, -1), w, t.reshape(rows, -1), b,
                             float(matmul.attr("alpha") or 1.0),
                             run.arena.pad_of(frame, source.inputs[0]),
                             run._parameter_pieces(matmul.inputs[1], frame))
    if operands is None or not _ran(prov.act, w.device, *operands, gu, h):
        return False
    lead = tuple(int(d) for d in shape[:-1])
    pairs = gu.view(*lead, ffn, 2)
    frame.env[source.outputs[0]] = frame.env[matmul.outputs[0]] = run._stand_in(gu)
    frame.env[gu_value] = run._stand_in(gu, lead + (2 * ffn,))
    frame.env[gate], frame.env[up] = pairs[..., 0], pairs[..., 1]
    frame.env[hidden] = run._after(site.swiglu, frame, hidden, h.view(*lead, ffn))
    run._gated_skip.update({(id(frame), site.split.id), (id(frame), site.swiglu.id)})
    run.lora_fused += 1
    run.lora_into_planned += 1
    run.gated_forward += 1
    return True


def interleaved_source(gate, up) -> torch.Tensor | None:
    """gu [rows, 2 F] where gate and up are its column-stride-2 views (`run_forward`'s),
    else None (a split's halves)."""
    if not all(isinstance(t, torch.Tensor) for t in (gate, up)) or gate.shape != up.shape \
            or gate.stride() != up.stride() or gate.dim() < 1 or gate.stride(-1) != 2 \
            or up.data_ptr() != gate.data_ptr() + gate.element_size():
        return None
    ffn = gate.shape[-1]
    rows = gate.numel() // max(ffn, 1)
    expected, step = [], 2 * ffn
    for size in reversed(gate.shape[:-1]):
        expected.insert(0, step)
        step *= size
    if list(gate.stride()[:-1]) != expected:
        return None
    return gate.as_strided((rows, 2 * ffn), (2 * ffn, 1), gate.storage_offset())


def run_down_dx(run, site: BackwardSite, pieces, frame, forward) -> bool:
    """down's d_x GEMM with swiglu's backward in its epilogue, d_gu written interleaved
    into gate/up's one-GEMM d_x scratch (module docstring); False (nothing done) where
    the forward did not take the gated path or the scratch is not laid."""
    from runtime.cuda.lora_kcat import dx_operands

    down, join = site.down, site.split_backward
    gu = interleaved_source(*(run._read(v, frame, forward)
                              for v in site.swiglu_backward.inputs[1:3]))
    if gu is None or not _usable(run, frame, ()):
        return False
    d_gu_value = join.outputs[0]
    run._widen_dx(site.swiglu_backward, frame, forward)  # d_gate_up into gate/up's scratch
    if not run.arena.is_widened(frame, d_gu_value) \
            or run._one_gemm_weight(site.gate_up, frame, forward) is None:
        return False
    prov = provider(gu.device)
    d_y, w, a, hidden = (run._read(v, frame, forward) for v in (
        down.base.inputs[0], down.base.inputs[2], down.first.inputs[2], down.base.inputs[1]))
    rows = gu.shape[0]
    d_gu = _planned(run, frame, join, d_gu_value, gu.shape[1], gu.dtype)
    h = hidden.reshape(rows, -1) if isinstance(hidden, torch.Tensor) else None
    if prov is None or d_gu is None or d_gu.shape[0] != rows or h is None \
            or h.shape[1] != w.shape[1]:
        return False
    if not _ran(prov.dact, w.device, *dx_operands(d_y, w, a, pieces), gu, d_gu, h):
        return False
    for value in (down.base.outputs[0], down.first.outputs[0], down.add.outputs[0],
                  *site.swiglu_backward.outputs[:2]):
        frame.env[value] = run._stand_in(h)
    shape = static_shape(frame.function, d_gu_value)
    frame.env[d_gu_value] = d_gu.view(*(int(d) for d in shape))
    run._interleaved.add((id(frame), d_gu_value))
    run._gated_skip.update({(id(frame), site.swiglu_backward.id), (id(frame), join.id)})
    run.lora_dx_fused += 1
    run.lora_dx_one_gemm += 1
    run.gated_backward += 1
    return True


def run_delta_grads(run, node, dx_pairs, frame, forward) -> bool:
    """gate/up's d_t and d_B over the interleaved d_gu (`node` reads it: the delta's
    matmul_backward, the only reader besides gate/up's deferred d_x GEMM): B's rows
    interleaved to match, d_B's rows put back; d_t written beside d_gu where the one GEMM
    reads it."""
    from runtime.cuda.lora_kcat import dt_beside
    from runtime.cuda.train_kernels import matmul_grads

    pair = run._dt_pair(node, dx_pairs, frame)
    if pair is None or node.target != "matmul_backward" or node.attr("transpose") != "NT":
        raise RuntimeError(f"internal: {node.id} ({node.target}) reads the interleaved "
                           f"{node.inputs[0]} (in `{frame.function.name}`)")
    d_gu, t, b = (run._read(v, frame, forward) for v in node.inputs)
    rows = d_gu.numel() // d_gu.shape[-1]
    w = run._one_gemm_weight(pair, frame, forward)
    target = dt_beside(w, rows, b.shape[1]) if w is not None else None
    d_t, d_b = matmul_grads(d_gu.reshape(rows, -1), t.reshape(rows, -1), interleaved(b),
                            wanted=(True, True), transpose="NT",
                            alpha=float(node.attr("alpha") or 1.0), out=[target, None])
    key = (id(frame), node.id)
    if target is not None:
        run._redirects[key] = target
    try:
        frame.env[node.outputs[0]] = run._after(node, frame, node.outputs[0], d_t)
    finally:
        run._redirects.pop(key, None)
    if node.outputs[1]:
        frame.env[node.outputs[1]] = run._after(node, frame, node.outputs[1],
                                                _rows_in_order(run, frame, node, d_b))
    return True


def _rows_in_order(run, frame, node, d_b: torch.Tensor) -> torch.Tensor:
    """d_B with its interleaved rows put back in order, written straight into its planned
    bytes where it has some (one copy, not a copy and then a move)."""
    into = _planned(run, frame, node, node.outputs[1], d_b.shape[1], d_b.dtype)
    if into is None or into.shape[0] != d_b.shape[0] or not into.is_contiguous():
        return deinterleaved(d_b)
    halves = d_b.view(d_b.shape[0] // 2, 2, d_b.shape[1]).transpose(0, 1)
    into.view(2, d_b.shape[0] // 2, d_b.shape[1]).copy_(halves)
    return into


def run_gate_up_dx(run, pair, pieces, out, frame, forward) -> torch.Tensor | None:
    """gate/up's d_x = d_gu W (W's rows read interleaved) + d_t A into `out`, where its d_y
    is the interleaved d_gu (`run_down_dx`); None where it is not."""
    from runtime.cuda.lora_kcat import dx_operands

    if (id(frame), pair.base.inputs[0]) not in run._interleaved:
        return None
    run._interleaved.discard((id(frame), pair.base.inputs[0]))
    d_y, w, a = (run._read(v, frame, forward)
                 for v in (pair.base.inputs[0], pair.base.inputs[2], pair.first.inputs[2]))
    wide, stacked = dx_operands(d_y, w, a, pieces)
    out2, d_gu = out.view(wide.shape[0], w.shape[1]), wide[:, :w.shape[0]]
    prov = provider(w.device)
    if prov is None or not _ran(prov.mm_rows_interleaved, w.device, d_gu, w, out2):
        d_gu.copy_(deinterleaved(d_gu, 1))  # [d_gate | d_up] for the usual one GEMM
        return None
    out2.addmm_(wide[:, w.shape[0]:], stacked[w.shape[0]:])
    return out2


def _ran(call, device, *args) -> bool:
    """call(*args); False where the provider raised (the step's usual path from then on:
    gated_gemm.refuse). Its first calls run eagerly (the step's warm-up), never inside a
    captured graph."""
    from runtime.cuda.gated_gemm import refuse

    try:
        call(*args)
    except Exception as error:  # a third-party kernel refusing a layout: reported, not fatal
        refuse(device, error)
        return False
    return True
