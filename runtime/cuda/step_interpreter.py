"""The GPU step's interpreter (runtime/cuda/step.py): the reference interpreter with the
training step's early release of planned recomputes and swaps, in-place RoPE, LoRA's
matmul + add as one addmm (and its backward's d_x sums: runtime/cuda/lora_backward.py),
each repeated layer's parameter gradients handed on as soon as they are final,
dropout seeded from a device counter (runtime/cuda/dropout.py), and the collectives the
IR marks `stream=comm` run on the communication stream (runtime/cuda/async_comm.py)."""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from modulec.ir.graph import STREAM
from runtime.cuda import stacked_blocks
from runtime.cuda.lora_backward import (DxPairs, add_into, lora_dx_pairs,
                                        stacked_param_grads, target_bytes, widened_parts)
from runtime.cuda.lora_pairs import LoraPairs, lora_addmm_pairs
from runtime.cuda.swaps import Stored
from runtime.cuda.train_kernels import (lora_addmm, lora_matmul_into, overlaps,
                                       planned_product)
from runtime.decisions import APPLY_SAVED, RECOMPUTE, SWAP, _forget
from runtime.interpreter import (Interpreter, _join, _keep_only_saved, _saved_by_backward,
                                 _shape, static_shape)
from runtime.kernels.documents import current
from runtime.kernels.tensor import block_layout

# where rope's and qk_norm_rope's nodes take position_ids (their reference kernels'
# forward_inputs / backward_inputs): a packed batch fills the slot when it is empty
POSITION_SLOTS = {"rope": 2, "rope_backward": 2, "qk_norm_rope": 4,
                  "qk_norm_rope_backward": 8}


def position_slot(node) -> int | None:
    slot = POSITION_SLOTS.get(node.target)
    return slot if slot is not None and len(node.inputs) > slot else None


class _StepInterpreter(Interpreter):
    """The interpreter, handing each repeated layer's parameter gradients to
    `on_gradient(path, grad)` once its backward frame has collected them (a layer's
    parameters get their gradient from that layer alone); the entry's stay in `grads`.
    With `decisions`, a forward function run drops the values decided `recompute` in it
    as soon as it returns (early release; the backward replays them when it reads them)."""

    def __init__(self, *args, on_gradient=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.on_gradient = on_gradient
        self.handed: set[str] = set()
        self.step = None
        self._pairs: dict = {}  # function name -> LoraPairs
        self._producers: dict = {}  # function name -> {value: the node making it}
        self._widened_parts: dict = {}  # function name -> lora_backward.widened_parts
        self._dt_makers: dict = {}  # function name -> {d_t value: its one-GEMM DxPair}
        self._residual_decided: dict = {}  # (function, node) -> residual_rows.takes_rows
        self._residual_at: set[int] = set()  # where _residual_rows wrote (data_ptr)
        self._scalars: dict = {}
        self.lora_fused = 0  # (matmul, add) pairs run as one addmm
        self.lora_into_planned = 0  # of those, written with base into y's planned bytes
        self.lora_t_beside_x = 0  # LoRA t written into x's spare columns (_t_beside_x)
        self.lora_dx_fused = 0  # backward d_x sums run as an addmm (lora_backward.py)
        self.lora_dx_one_gemm = 0  # of them, one GEMM over [d_y | d_t] (lora_kcat.dx_into)
        self.stacked_block_grads = 0  # block_diag backwards given views (stacked_blocks.py)
        self._stacked_rows: dict = {}  # (function, matmul backward id) -> the blocks' rows
        self._stacked: dict = {}  # (id(frame), d_B value) -> (stacked d_B, the blocks' rows)
        self._dx_staged: dict = {}  # (id(frame), add id) -> True: d_t staged for dx_into
        self._dx_pairs: dict = {}  # function name -> lora_backward.DxPairs
        self._redirects: dict = {}  # (id(frame), node id) -> the add's bytes for its d_x
        self._own: dict = {}  # function name -> values kept out of the arena (_own_bytes)
        self._in_place: dict = {}  # function name -> node ids run in place
        # SwiGLU in the GEMMs' epilogues (runtime/cuda/gated_mlp.py): function name -> its
        # sites; the (id(frame), node id) the gated GEMMs ran for; the (id(frame), value)
        # holding an interleaved d_gu
        self._gated_sites: dict = {}
        self._gated_skip: set = set()
        self._interleaved: set = set()
        self.gated_forward = 0  # gate/up + swiglu run as one gated GEMM
        self.gated_backward = 0  # down's d_x + swiglu's backward as one gated GEMM
        self.swaps = None  # runtime.cuda.swaps.GpuSwaps: the step's, when it executes swaps
        self._released_at: dict = {}  # id(forward run) -> its release number (swaps)
        from runtime.cuda.kernels import APPLY_SAVED_KERNELS

        self.apply_saved_kernels = APPLY_SAVED_KERNELS
        self.in_place_runs = 0
        # random ops (dropout) in a training run: (the step's device counter, this run's
        # salt: rank and micro-batch); None draws nothing (evaluation)
        self.rng = None
        self.fp8_run = None  # runtime.cuda.fp8_step.StepFp8: the program's FP8 recipe
        # runtime.cuda.async_comm.InFlight: ops marked `stream=comm` run on the comm stream,
        # joined at their `wait` (None: in program order, as the reference runs them)
        self.in_flight = None

    def _seed(self, node, frame):
        """A `DeviceSeed` (runtime/cuda/dropout.py): the step's device counter and a key
        fixed per op run, so a captured graph draws new masks each replay and a recompute
        the same one."""
        if self.rng is None:
            return super()._seed(node, frame)
        import zlib

        from runtime.cuda.dropout import DeviceSeed

        counter, salt = self.rng
        key = f"{salt}/{frame.path}/{frame.indices}/{node.id}"
        return DeviceSeed(counter, zlib.crc32(key.encode()))

    def forward(self, inputs: list):
        outputs, frame = super().forward(inputs)
        if self.keep_only_saved:  # the sinks (runs by argument) would keep every run alive
            self._sinks = {}
        return outputs, frame

    def _run(self, frame, args: list, forward) -> list:
        """Interpreter._run for a forward function, but keep_only_saved keeps what a
        replay reads too (`_kept`), and the run's `recompute` values are dropped. After a
        backward function ran, its forward run is emptied (values, callees, where its
        arguments came from): nothing (no reference cycle either) keeps its saved or
        replayed values past its backward."""
        function = frame.function
        if function.gradient_of:
            if self.swaps is not None and id(forward) in self._released_at:
                self.swaps.prefetch_for(self._released_at[id(forward)])
            outputs = super()._run(frame, args, forward)
            self._gated_done(frame)
            if self.keep_only_saved and forward is not None:
                forward.env.clear()
                forward.children.clear()
                forward.forgotten.clear()
            return outputs
        if self.decisions is None:
            return super()._run(frame, args, forward)
        self._frame_begin(frame)  # ZeRO-3 gathers this layer's (or the entry's) weights
        frame.env.update({i.id: a for i, a in zip(function.inputs, args)})
        for node in function.nodes:
            self._dispatch(node, frame, forward)
        outputs = [frame.env.get(o) if o else None for o in function.outputs]
        # release first: keep_only_saved would put a stand-in in place of a released value
        # a callee saved (a block's norm output, the attention's / MLP's `x`), and the
        # callee's copy of the tensor would no longer be found and forgotten (it was held
        # to the backward: 2 x 32 MiB a layer on the TinyLlama shape)
        self._release_run(frame)
        if self.keep_only_saved:
            _keep_only_saved(frame, self._kept(function.name))
        return outputs

    def _kept(self, name: str) -> frozenset:
        """The values of forward function `name` its backward saves, and every input and
        output of a node the decisions may replay there."""
        if not hasattr(self, "_kept_by"):
            self._kept_by = {}
        if name not in self._kept_by:
            from modulec.plan.replay import APPLY_SAVED as RULES

            extra = set()
            for node in self.graph.function(name).nodes:
                modes = {mode for mode, _ in self.decisions.replays.get((name, node.id), ())}
                if "op" in modes:
                    extra.update(node.inputs)
                if APPLY_SAVED in modes:  # the saved (residual) input / output and stats
                    _, sources = RULES[node.target]
                    extra.update(node.outputs[i] if kind == "out" else node.inputs[i]
                                 for kind, i in sources)
            self._kept_by[name] = _saved_by_backward(self.graph, name) | (extra - {""})
        return self._kept_by[name]

    def _release_run(self, frame) -> None:
        """Drop this run's values decided `recompute` (and forget them where a callee
        received them); copy out those decided `swap` (runtime/cuda/swaps.py; kept on the
        GPU when the step does not execute swaps, counted in `swaps_kept`)."""
        decisions, name = self.decisions, frame.function.name
        swapped = {}
        for value in list(frame.env):
            kind = decisions.of(name, value, frame.instance)
            if kind == RECOMPUTE:
                decisions._release(frame, value, kind, self._sinks)
            elif kind == SWAP and self.step is not None:
                tensor = frame.env[value]
                if self.swaps is not None and isinstance(tensor, torch.Tensor) and tensor.is_cuda:
                    swapped[value] = tensor
                else:
                    self.step.swaps_kept += 1
        if self.swaps is None:
            return
        for stored in self.swaps.swap_out(frame, swapped) if swapped else ():
            for value in stored.views:
                _forget(frame, value, frame.env.pop(value), self._sinks)
                frame.host[value] = stored
                decisions.counts["swapped_out"] += 1
        self._released_at[id(frame)] = self.swaps.releases
        self.swaps.released()

    def _restore(self, frame, value: str) -> bool:
        stored = frame.host.get(value)
        if isinstance(stored, Stored):
            del frame.host[value]
            frame.env[value] = self.swaps.restore(stored, value)
            self.decisions.counts["swapped_in"] += 1
            return True
        return super()._restore(frame, value)

    def _op(self, node, frame, forward) -> None:
        """LoRA's `d = matmul(t, B, NT, alpha=s)` + `y = add(base, d)` (`lora_addmm_pairs`)
        as one addmm: the matmul is deferred to the add, which writes y = base + s t B^T
        (into base where nothing else reads it); d gets a shape-only stand-in (the add's
        derived backward reads its shape; d's matmul backward reads t and B, not d). On
        the arena, base's own matmul is deferred too where it can be (`LoraPairs.bases`):
        d's GEMM writes y's planned bytes and base's adds into them, so nothing is copied
        in. In a backward, LoRA's d_x sums run as addmms (`_lora_dx`)."""
        function = frame.function
        if self.in_flight is not None and node.attr(STREAM) is not None:
            return self.in_flight.issue(self, node, frame, forward, super()._op)
        if self.fp8_run is not None and node.target in FP8_TARGETS and any(node.outputs) \
                and self.fp8_run.covers(function.name, node.id):
            return self._fp8_op(node, frame, forward)
        plain = self._plain()
        if plain and (id(frame), node.id) in self._gated_skip:
            self._gated_skip.discard((id(frame), node.id))
            return  # run by a gated GEMM (runtime/cuda/gated_mlp.py)
        if function.gradient_of and plain and (self._residual_rows(node, frame, forward)
                                               or self._lora_dx(node, frame, forward)
                                               or self._stacked_parts(node, frame)):
            return
        if plain and not function.gradient_of and self._fp8_produced(node, frame):
            return
        if function.gradient_of or not plain:
            return super()._op(node, frame, forward)
        if node.id in self._in_place_of(function) and self._rope_in_place(node, frame, forward):
            return
        if node.target == "block_diag" and self._block_slot(node, frame):
            return
        pairs = self._lora_pairs(function)
        if node.id in pairs.deferred:
            return  # run by its add
        source = pairs.t_makers.get(node.id)
        if source is not None and self._t_beside_x(node, source, frame, forward):
            return
        pair = pairs.adds.get(node.id)
        if pair is None:
            return super()._op(node, frame, forward)
        source = pairs.bases.get(node.id)
        if source is not None:
            if self._gated_forward(node, source, pair[0], frame, forward) \
                    or self._lora_into_planned(node, source, pair[0], frame, forward):
                return
            super()._op(source, frame, forward)  # base as written, then the addmm
        self._lora_add(node, pair, frame, forward)

    def _plain(self) -> bool:
        """Nothing watches this run's values (no replay, hooks or profiler)."""
        return not self._replaying and self.hooks is None and self.profiler is None

    def _wait(self, node, frame) -> None:
        """The compute stream joins the async op `node.target` (runtime/cuda/async_comm.py)."""
        if self.in_flight is not None:
            self.in_flight.wait(node, frame)

    def _lora_add(self, node, pair, frame, forward) -> None:
        function = frame.function
        matmul, inplace = pair
        base = self._read(node.inputs[0], frame, forward)
        t = self._read(matmul.inputs[0], frame, forward)
        b = self._read(matmul.inputs[1], frame, forward)
        if inplace and self.arena is not None:
            inplace = False
        if inplace and self.decisions is not None and self.decisions.of(
                function.name, node.inputs[0], frame.instance) in (RECOMPUTE, SWAP):
            inplace = False
        y = lora_addmm(base, t, b, float(matmul.attr("alpha") or 1.0), inplace)
        if y is None:  # operands that do not fit: the two ops as written
            super()._op(matmul, frame, forward)
            return super()._op(node, frame, forward)
        self.lora_fused += 1
        frame.env[matmul.outputs[0]] = self._stand_in(y)
        frame.env[node.outputs[0]] = self._after(node, frame, node.outputs[0], y)

    def _t_beside_x(self, node, source, frame, forward) -> bool:
        """LoRA's t = x A^T written straight into x's spare columns, where the one GEMM
        over [x | t] reads it (runtime/cuda/lora_kcat.py `t_beside_x`): nothing is copied
        there, and the backward reads t where it lies (rows apart). Only where the plan laid
        x `r` wider and x's bytes hold to the backward (which reads x after t: d_A needs
        d_t): under the planner's decisions, x made in this function and neither it nor t
        dropped, swapped or re-applied (t would go with x's bytes). True where `node` ran."""
        from runtime.cuda.lora_kcat import t_beside_x

        t, x_value = (node.outputs[0] if node.outputs else ""), source.inputs[0]
        shape = static_shape(frame.function, t) if t else None
        if self.arena is None or shape is None \
                or self.arena.pad_of(frame, x_value) != shape[-1]:
            return False
        if self.decisions is not None and (
                x_value not in self._producers_of(frame.function)
                or any(self.decisions.of(frame.function.name, v, frame.instance)
                       in (RECOMPUTE, SWAP, APPLY_SAVED) for v in (t, x_value))):
            return False
        x, w = (self._read(v, frame, forward) for v in (x_value, source.inputs[1]))
        target = t_beside_x(x, w, shape[-1])
        if target is None:
            return False
        self._run_redirected(node, frame, forward, target)
        self.lora_t_beside_x += 1
        return True

    def _gated_forward(self, node, source, matmul, frame, forward) -> bool:
        """gate_up's add and the split + swiglu after it as one gated GEMM
        (runtime/cuda/gated_mlp.py `run_forward`). True where it ran."""
        from runtime.cuda import gated_mlp

        function = frame.function
        key = ("forward", function.name)
        if key not in self._gated_sites:
            self._gated_sites[key] = gated_mlp.sites(self.graph, function,
                                                     self._lora_pairs(function))
        site = self._gated_sites[key].get(node.id)
        return site is not None and gated_mlp.run_forward(self, site, source, matmul, frame,
                                                          forward)

    def _gated_done(self, frame) -> None:
        """Forget what the gated GEMMs noted for `frame` (its id may be a later frame's)."""
        if self._interleaved or self._gated_skip:
            self._interleaved = {k for k in self._interleaved if k[0] != id(frame)}
            self._gated_skip = {k for k in self._gated_skip if k[0] != id(frame)}

    def _gated_backward_site(self, node, frame):
        """The gated MLP backward site `node` belongs to (gated_mlp.backward_sites)."""
        from runtime.cuda import gated_mlp

        key = ("backward", frame.function.name)
        if key not in self._gated_sites:
            self._gated_sites[key] = gated_mlp.backward_sites(
                frame.function, self._dx_pairs_of(frame.function))
        return self._gated_sites[key].get(node.id)

    def _lora_into_planned(self, node, source, matmul, frame, forward) -> bool:
        """y = x W^T (`source`, base's matmul) + s t B^T in y's planned bytes: the delta
        written there first, then base's GEMM adds into them (beta = 1;
        train_kernels.lora_matmul_into): y written once, no pass of the delta over it. False
        (nothing done) off the arena, where y has no bytes of its own, or where an operand
        lies in them (a plan may give y the bytes of a value dead before the add)."""
        raw = self.arena.out_bytes(frame, node, node.outputs[0]) if self.arena else None
        operands = [self._read(v, frame, forward) for v in (*source.inputs, *matmul.inputs)]
        if raw is None or any(overlaps(v, raw) for v in operands):
            return False
        x, w, t, b = operands
        y = lora_matmul_into(x, w, self._attrs(source), t, b,
                             float(matmul.attr("alpha") or 1.0), raw,
                             self.arena.pad_of(frame, source.inputs[0]),
                             self._parameter_pieces(matmul.inputs[1], frame))
        if y is None:
            return False  # the caller runs both as written
        self.lora_fused += 1
        self.lora_into_planned += 1
        frame.env[source.outputs[0]] = frame.env[matmul.outputs[0]] = self._stand_in(y)
        frame.env[node.outputs[0]] = self._after(node, frame, node.outputs[0], y)
        return True

    def _parameter_pieces(self, value: str, run) -> list | None:
        """The parameters adapter matrix `value` of function run `run` is made of and where
        each lies in it, (tensor, row, column): the matrix itself where it is a parameter;
        each block of a block_diag of parameters (the `lora` pass's B of a fused
        projection) or each part of a dim-0 concat of them (its stacked A); None for
        anything else (runtime/cuda/slot_refresh.py fills from parameters alone)."""
        if value.startswith("param:"):
            return [(self._read(value, run, None), 0, 0)]
        node = self._producers_of(run.function).get(value)
        stacked = node is not None and node.target == "concat" \
            and int(node.attr("dim") or 0) == 0
        if node is None or not (stacked or node.target == "block_diag") or not node.inputs \
                or not all(v.startswith("param:") for v in node.inputs):
            return None
        parts = [self._read(v, run, None) for v in node.inputs]
        shapes = [tuple(p.shape) for p in parts]
        if stacked:
            places = [(sum(rows for rows, _ in shapes[:i]), 0) for i in range(len(shapes))]
        else:
            places = block_layout(shapes, [int(r) for r in node.attr("zero_rows") or ()])[0]
        return [(part, row, col) for part, (row, col) in zip(parts, places)]

    def _backward_context(self, kernel, node, inputs, attrs, forward, frame_function):
        """The base's, plus for an NT matmul whose B is a block_diag of 16-wide blocks (the
        `lora` pass's B of a fused projection) the blocks' rows (`b_blocks`: the one-pass
        gradients then sum each block alone, runtime/cuda/skinny_grads.py)."""
        inputs, attrs = super()._backward_context(kernel, node, inputs, attrs, forward,
                                                  frame_function)
        origin = node.attr("forward_node")
        if node.target != "matmul_backward" or attrs.get("transpose") != "NT" \
                or forward is None or origin is None:
            return inputs, attrs
        op = next((n for n in forward.function.nodes if n.id == origin), None)
        made = op is not None and len(op.inputs) > 1 and \
            self._producers_of(forward.function).get(op.inputs[1])
        if made and made.target == "block_diag" and not any(made.attr("zero_rows") or ()):
            shapes = [_shape(v, forward, self) for v in made.inputs]
            if all(s is not None and len(s) == 2 and s[1] == 16 for s in shapes):
                attrs["b_blocks"] = [s[0] for s in shapes]
                if self._plain() and stacked_blocks.reader(frame_function, node) is not None:
                    attrs["b_compact"] = True  # d_B's blocks stacked, for `_stacked_parts`
                    self._stacked_rows[(frame_function.name, node.id)] = attrs["b_blocks"]
        return inputs, attrs

    def _producers_of(self, function) -> dict:
        if function.name not in self._producers:
            self._producers[function.name] = {o: n for n in function.nodes
                                              for o in n.outputs if o}
        return self._producers[function.name]

    def _lora_dx(self, node, frame, forward) -> bool:
        """LoRA's d_x sums without an add (runtime/cuda/lora_backward.py): the adapter
        path's d_x written into the sum's bytes, the frozen weight's d_x GEMM deferred to
        the add and added there. True where `node` was run (or deferred) here."""
        from runtime.cuda.gated_mlp import run_delta_grads

        pairs = self._dx_pairs_of(frame.function)
        self._widen_dx(node, frame, forward)
        if node.id not in pairs.deferred and node.inputs \
                and (id(frame), node.inputs[0]) in self._interleaved:
            return run_delta_grads(self, node, pairs, frame, forward)
        if self._dt_beside_dy(node, pairs, frame, forward):
            return True
        if node.id in pairs.deferred:
            return True  # run by its add
        pair = pairs.firsts.get(node.id)
        if pair is not None and self._stage_one_gemm_dx(pair, frame, forward):
            return True
        if pair is not None:
            self._run_redirected(node, frame, forward, target_bytes(self, pair, frame, forward))
            return True
        pair = pairs.adds.get(node.id)
        if pair is None:
            return False
        if self._dx_staged.pop((id(frame), node.id), False):
            return self._one_gemm_dx(pair, frame, forward)
        if (id(frame), pair.base.inputs[0]) in self._interleaved:  # gated_mlp.run_down_dx's
            raise RuntimeError(f"internal: {node.id}'s d_y is interleaved but its d_x sum "
                               f"is not one GEMM (in `{frame.function.name}`)")
        y = add_into(self, pair, frame, forward)
        if y is None:  # as written
            super()._op(pair.base, frame, forward)
            super()._op(node, frame, forward)
            return True
        self.lora_dx_fused += 1
        frame.env[pair.base.outputs[0]] = self._stand_in(y)
        frame.env[node.outputs[0]] = self._after(node, frame, node.outputs[0], y)
        return True

    def _residual_rows(self, node, frame, forward) -> bool:
        """A fused residual norm's backward writes the residual gradient into the one-GEMM
        d_x scratch's left columns (runtime/cuda/residual_rows.py), where o_proj's and
        down_proj's backward read it beside their d_t. True where `node` was run here."""
        from runtime.cuda.residual_rows import RESIDUAL_NORM_BACKWARDS, residual_target, settle

        if self.arena is None or node.target not in RESIDUAL_NORM_BACKWARDS:
            return False
        target = residual_target(self.graph, frame.function, node,
                                 self._read(node.inputs[1], frame, forward),
                                 self._residual_decided)
        if target is None:
            return False
        self._run_redirected(node, frame, forward, target)
        settle(frame, node, target)
        self._residual_at.add(target.data_ptr())
        return True

    def _hand_over(self, frame, node, child, values: list, remaining: int) -> list:
        """The interpreter's, but a residual gradient in the one-GEMM scratch
        (`_residual_rows`) is handed on where it is, not copied into the caller's bytes."""
        kept = {k: v for k, v in enumerate(values)
                if isinstance(v, torch.Tensor) and v.data_ptr() in self._residual_at}
        if not kept:
            return super()._hand_over(frame, node, child, values, remaining)
        rest = [None if k in kept else v for k, v in enumerate(values)]
        handed = super()._hand_over(frame, node, child, rest, remaining)
        self._placed = [kept.get(k, v) for k, v in enumerate(handed)]
        return self._placed

    def _widen_dx(self, node, frame, forward) -> None:
        """Before `node` writes a fused projection's d_y (a concat planned in place, or a
        part of it) whose weight was laid with tail rows (lora_kcat.tail_rows: q/k/v,
        gate/up), the concat and its parts move into the one-GEMM d_x's scratch for this
        run (runtime/arena.py `widen`): its producers write d_y beside where d_t goes, so
        `dx_into` copies nothing in."""
        from runtime.cuda.lora_kcat import widened_dx

        if self.arena is None:
            return
        name = frame.function.name
        if name not in self._widened_parts:
            self._widened_parts[name] = widened_parts(
                frame.function, self._dx_pairs_of(frame.function),
                self.arena.joins.get(name, {}))
        for value in node.outputs:
            pair, concat = self._widened_parts[name].get(value, (None, None))
            if pair is None or self.arena.is_widened(frame, concat):
                continue
            w = self._read(pair.base.inputs[2], frame, forward)
            shape = static_shape(frame.function, concat)
            if not isinstance(w, torch.Tensor) or w.dim() != 2 or shape is None:
                continue
            found = widened_dx(w, math.prod(shape) // w.shape[0])
            if found is not None:
                self.arena.widen(frame, concat, found[0], w.shape[0], found[1])

    def _dy_widened(self, pair, frame) -> bool:
        """`_widen_dx` moved the pair's d_y (or the concat it views) into the scratch."""
        found = self._widened_parts.get(frame.function.name, {}).get(pair.base.inputs[0])
        return found is not None and self.arena.is_widened(frame, found[1])

    def _dt_beside_dy(self, node, pairs, frame, forward) -> bool:
        """The node making a one-GEMM pair's d_t (the delta's matmul backward) writes it
        straight into the scratch's columns beside d_y (`_redirects`; the one-pass
        gradients' finishing launch writes rows apart), so staging it copies nothing.
        True where `node` was run here."""
        from runtime.cuda.lora_kcat import dt_beside

        if node.target != "matmul_backward" or not node.outputs or not node.outputs[0]:
            return False
        pair = self._dt_pair(node, pairs, frame)
        w = self._one_gemm_weight(pair, frame, forward) if pair is not None else None
        shape = static_shape(frame.function, node.outputs[0])
        target = None if w is None or shape is None else \
            dt_beside(w, math.prod(shape) // shape[-1], shape[-1])
        if target is None:
            return False
        self._run_redirected(node, frame, forward, target)
        return True

    def _dt_pair(self, node, pairs, frame):
        """The one-GEMM pair whose d_t `node` makes (its output 0), or None."""
        name = frame.function.name
        if name not in self._dt_makers:
            self._dt_makers[name] = {p.first.inputs[0]: p for p in pairs.adds.values()}
        return self._dt_makers[name].get(node.outputs[0]) if node.outputs else None

    def _run_redirected(self, node, frame, forward, target) -> None:
        """Run `node` with its first output written into `target` (`_out_bytes`, `_after`)
        where given, else as planned."""
        key = (id(frame), node.id)
        if target is not None:
            self._redirects[key] = target
        try:
            super()._op(node, frame, forward)
        finally:
            self._redirects.pop(key, None)

    def _one_gemm_weight(self, pair, frame, forward):
        """The frozen weight of a pair whose d_x sum may be one GEMM (`_stage_one_gemm_dx`:
        tail rows laid, d_y written into the scratch or a copy of it paying), else None."""
        from runtime.cuda.lora_kcat import copy_pays, dy_in_scratch, laid_tails

        first, base = pair.first, pair.base
        if not laid_tails() or first.attr("transpose") != "NT" or len(first.inputs) != 3 \
                or float(first.attr("alpha") or 1.0) != 1.0 \
                or float(base.attr("alpha") or 1.0) != 1.0:
            return None
        w = self._read(base.inputs[2], frame, forward)
        if not isinstance(w, torch.Tensor) or w.dim() != 2:
            return None
        widened = self.arena is not None and (self._dy_widened(pair, frame) or dy_in_scratch(
            self._read(base.inputs[0], frame, forward), w))
        return w if widened or copy_pays(w) else None

    def _stage_one_gemm_dx(self, pair, frame, forward) -> bool:
        """Where the frozen weight was laid with its adapters' A rows after it
        (lora_kcat.tail_rows), the d_x sum is one GEMM at the add (`_one_gemm_dx`): here
        the adapter path's d_t is staged beside where d_y goes (already there where its
        maker wrote it so: `_dt_beside_dy`) and its node runs for d_A alone. Where d_y was
        written into the scratch (`_widen_dx`: q/k/v, gate/up) or copying it there pays
        (down_proj); False (nothing done) elsewhere."""
        from runtime.cuda.lora_kcat import stage_dt

        first = pair.first
        w = self._one_gemm_weight(pair, frame, forward)
        if w is None:
            return False
        d_t, a = (self._read(v, frame, forward) for v in (first.inputs[0], first.inputs[2]))
        if not all(isinstance(t, torch.Tensor) for t in (d_t, a)) or not stage_dt(d_t, w, a):
            return False
        super()._op(replace(first, outputs=("", *first.outputs[1:])), frame, forward)
        self._dx_staged[(id(frame), pair.add.id)] = True
        return True

    def _one_gemm_dx(self, pair, frame, forward) -> bool:
        """d_x = [d_y | d_t] [W ; A] (lora_kcat.dx_into) into the add's planned bytes (a
        tensor of its own off the arena or where they hold an operand)."""
        from runtime.cuda.gated_mlp import run_down_dx, run_gate_up_dx
        from runtime.cuda.lora_kcat import dx_into

        base, add = pair.base, pair.add
        a_pieces = self._parameter_pieces(pair.first.inputs[2], forward) if forward else None
        site = self._gated_backward_site(add, frame)
        if site is not None and add is site.down.add \
                and run_down_dx(self, site, a_pieces, frame, forward):
            return True
        d_y, w, a = (self._read(v, frame, forward)
                     for v in (base.inputs[0], base.inputs[2], pair.first.inputs[2]))
        shape = (*d_y.shape[:-1], w.shape[1])
        raw = self.arena.out_bytes(frame, add, add.outputs[0]) if self.arena else None
        out = None if raw is None or any(overlaps(t, raw) for t in (d_y, w, a)) else \
            planned_product(raw, d_y.reshape(-1, w.shape[0]), w)
        if out is None:
            out = torch.empty(shape, dtype=w.dtype, device=w.device)
        y = run_gate_up_dx(self, pair, a_pieces, out, frame, forward)
        if y is None:
            y = dx_into(d_y, w, a, out, a_pieces)
        self.lora_dx_fused += 1
        self.lora_dx_one_gemm += 1
        for value in (base.outputs[0], pair.first.outputs[0]):
            frame.env[value] = self._stand_in(y)
        frame.env[add.outputs[0]] = self._after(add, frame, add.outputs[0], y.view(shape))
        return True

    def _dx_pairs_of(self, function) -> DxPairs:
        if function.name not in self._dx_pairs:
            fp8 = {n.id for n in function.nodes if self.fp8_run is not None
                   and self.fp8_run.covers(function.name, n.id)}
            self._dx_pairs[function.name] = lora_dx_pairs(function, fp8)
        return self._dx_pairs[function.name]

    def _out_bytes(self, kernel, node, frame, attrs) -> None:
        """The arena's planned bytes, but the add's for an adapter path's d_x redirected
        there (`_lora_dx`), and none for a stacked parameter gradient (`_own_bytes`)."""
        super()._out_bytes(kernel, node, frame, attrs)
        raw = self._redirects.get((id(frame), node.id))
        if raw is not None and attrs.get("out"):
            attrs["out"][0] = raw
        own = self._own_bytes(frame.function)
        if attrs.get("out") and own:
            attrs["out"] = [None if v in own else b for v, b in zip(node.outputs, attrs["out"])]

    def _after(self, node, frame, value, tensor):
        """A redirected result stays where it was written (`_lora_dx`'s d_x in the add's
        bytes: its add takes it there; `_residual_rows`' in the one-GEMM scratch);
        a stacked parameter gradient (`_own_bytes`) stays in its own; a d_B whose blocks'
        gradients came back stacked is kept for `_stacked_parts` (a stand-in in its place)."""
        rows = self._stacked_rows.get((frame.function.name, node.id))
        shape = static_shape(frame.function, value) if rows is not None else None
        if rows is not None and value == node.outputs[1] and stacked_blocks.stacked(tensor, shape):
            self._stacked[(id(frame), value)] = (tensor, rows)
            return self._stand_in(tensor, shape)
        raw = self._redirects.get((id(frame), node.id))
        if raw is not None and value in node.outputs and isinstance(tensor, torch.Tensor) \
                and tensor.data_ptr() == raw.data_ptr():
            self._finite(node, frame, value, tensor, "")
            return tensor
        if self.hooks is None and value in self._own_bytes(frame.function) \
                and isinstance(tensor, torch.Tensor) and not self._replaying:
            self._finite(node, frame, value, tensor, "")
            return tensor
        return super()._after(node, frame, value, tensor)

    def _own_bytes(self, function) -> frozenset:
        """Values of backward `function` kept in the bytes their kernel allocated, not the
        arena's: LoRA's stacked adapter gradients (a fused projection's `[k*r, in]` d_A) read
        by concat_backward alone whose parts are all parameter gradients (contiguous row
        blocks: a parameter gradient in the arena is cloned out of it, one copy each; in
        bytes of their own the parts are handed to the optimizer as they are)."""
        if function.name not in self._own:
            self._own[function.name] = stacked_param_grads(function) \
                if self.arena is not None else frozenset()
        return self._own[function.name]

    def _stand_in(self, like: torch.Tensor, shape=None) -> torch.Tensor:
        """A shape-only stand-in for a value never materialized (one scalar, expanded to
        `shape`, or like's)."""
        key = (like.dtype, like.device)
        if key not in self._scalars:
            self._scalars[key] = torch.empty((), dtype=like.dtype, device=like.device)
        return self._scalars[key].expand(like.shape if shape is None else tuple(shape))

    def _block_slot(self, node, frame) -> bool:
        """LoRA's block-diagonal B from its slot (stacked_blocks.block_slot); True if so."""
        pieces = self._parameter_pieces(node.outputs[0], frame) if node.outputs else None
        slot = stacked_blocks.block_slot(self, node, frame, pieces)
        if slot is not None:
            frame.env[node.outputs[0]] = slot
        return slot is not None

    def _stacked_parts(self, node, frame) -> bool:
        """block_diag's backward over a d_B whose blocks' gradients came back stacked
        (runtime/cuda/stacked_blocks.py): each block's gradient is its rows of them, no
        launch. True where `node` was run here."""
        found = self._stacked.pop((id(frame), node.inputs[0]), None) \
            if node.target == "block_diag_backward" and node.inputs else None
        if found is None:
            return False
        for value, part in zip(node.outputs, stacked_blocks.parts(*found)):
            if value:
                frame.env[value] = self._after(node, frame, value, part)
        self.stacked_block_grads += 1
        return True

    def _fp8_produced(self, node, frame) -> bool:
        """Forward `node` run with its output's fp8 copy written in its pass, where it is
        an FP8 matmul's input under delayed scaling (runtime/cuda/fp8_producers.py, opt-in)."""
        from runtime.cuda import fp8_producers

        if self.fp8_run is None or not fp8_producers.FUSED \
                or node.target not in fp8_producers.PRODUCERS:
            return False
        return fp8_producers.producers_of(self.fp8_run, self.graph).run(self, node, frame)

    def _fp8_op(self, node, frame, forward) -> None:
        """A matmul (or its backward) the FP8 recipe covers: FP8 GEMMs (fp8_step.py)."""
        inputs = [self._read(v, frame, forward) if v else None for v in node.inputs]
        attrs = self._attrs(node)  # on the arena, attrs["out"]: the planned bytes (Matmul's)
        self._out_bytes(self.kernels.get("matmul"), node, frame, attrs)
        outputs = self.fp8_run.run_op(node, frame, forward, inputs, attrs)
        for value, tensor in zip(node.outputs, outputs):
            if value:
                frame.env[value] = self._after(node, frame, value, tensor)

    def _in_place_of(self, function) -> frozenset:
        """The nodes of `function` the planner counts in place (modulec.plan.in_place),
        less those a planned replay runs again (it would read the overwritten inputs)."""
        if function.name not in self._in_place:
            from modulec.plan.in_place import in_place_nodes

            self._in_place[function.name] = in_place_nodes(self.graph, function) \
                - self._replayed(function)
        return self._in_place[function.name]

    def _replayed(self, function) -> set:
        """Ids of `function`'s nodes a planned replay runs again."""
        if self.decisions is None:
            return set()
        return {n for (f, n), modes in self.decisions.replays.items()
                if f == function.name and modes}

    def _inputs(self, node, frame, forward) -> list:
        """In a packed batch (`packed(documents)`, runtime/cuda/packed.py) a rope or
        qk_norm_rope node (forward or backward) without position_ids of its own gets the
        documents' restarting positions, which the CUDA rope kernels take."""
        inputs = super()._inputs(node, frame, forward)
        slot = position_slot(node)
        if slot is not None and inputs[slot] is None:
            documents = current()
            if documents is not None:
                inputs[slot] = documents.positions
        return inputs

    def _rope_in_place(self, node, frame, forward) -> bool:
        """rope over its q and k (views of the fused QKV projection output); False where
        the kernel does not cover the inputs (the op then runs as written)."""
        from runtime.cuda.kernels import _extension, rope_args

        q, k, position_ids = self._inputs(node, frame, forward)
        if not all(isinstance(t, torch.Tensor) and t.is_cuda and t.dim() == 4
                   and t.stride(-1) == 1 and t.dtype in (torch.bfloat16, torch.float32)
                   and t.dtype == q.dtype for t in (q, k)):
            return False
        args = rope_args(self._attrs(node), q, position_ids)
        _extension().rope_pair(q, k, position_ids, *args, False)  # one launch, in place
        for x, out in zip((q, k), node.outputs):
            frame.env[out] = self._after(node, frame, out, x)
        self.in_place_runs += 1
        return True

    def _lora_pairs(self, function) -> LoraPairs:
        if function.name not in self._pairs:
            saved = _saved_by_backward(self.graph, function.name)
            fp8 = {n.id for n in function.nodes if self.fp8_run is not None
                   and self.fp8_run.covers(function.name, n.id)}  # FP8 GEMMs: not fused
            self._pairs[function.name] = lora_addmm_pairs(function, saved,
                                                          self._replayed(function) | fp8)
        return self._pairs[function.name]

    def _attrs(self, node):
        """A matmul backward with an unwanted gradient (a frozen weight's d_B) is told so
        (`train_kernels.Matmul` then computes only the wanted one); so is a gated
        activation's backward whose y is unwanted (a derived one's: its kernel then writes
        the gradients only) and an RMSNorm backward whose d_weight is unwanted (its kernel
        skips the weight's sums)."""
        attrs = super()._attrs(node)
        if node.target in PARTIAL_BACKWARDS and not all(node.outputs):
            attrs["wanted_outputs"] = tuple(bool(o) for o in node.outputs)
        if node.target in NORM_BACKWARDS and not node.outputs[-1]:
            attrs["weight_grad"] = False  # a frozen norm weight (kernels.py `_weight_grad`)
        return attrs

    def _collect_param_grads(self, frame) -> None:
        super()._collect_param_grads(frame)
        if self.on_gradient is None or not frame.indices:
            return
        for name, _ in frame.function.param_grads:
            path = _join(frame.path, name)
            if path in self.handed:
                raise RuntimeError(f"{path}: a second gradient after the update")
            if path in self.grads:
                self.handed.add(path)
                self.on_gradient(path, self.grads.pop(path))


MATMUL_BACKWARDS = ("matmul_backward", "batched_matmul_backward")
# backwards whose kernels compute only the outputs `wanted_outputs` asks for
PARTIAL_BACKWARDS = MATMUL_BACKWARDS + ("swiglu_backward", "geglu_backward")
NORM_BACKWARDS = ("rmsnorm_backward", "fused_residual_rmsnorm_backward")  # d_weight last
FP8_TARGETS = ("matmul", "matmul_backward")
