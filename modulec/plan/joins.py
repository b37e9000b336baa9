"""Concats planned in place: each part is made where the concat's output will hold it.

A concat (or split's derived backward, which is one) whose parts are buffers an op of the
same function made for it alone (read by the concat only, not saved, not a result of the
function, not a view or written over an input), or transposes of such buffers, gets its
parts as views of its output, as a split's parts are views of its input:
the ops that make the parts write into the output's bytes, and the concat itself moves
nothing. A part on an inner dim (SwiGLU's d_gate and d_up, halves of each row of the fused
up projection's gradient) is strided there; a kernel that cannot write strided rows
computes it on its own and the runtime copies it in, which is the concat's copy, no more.

The planner reads the byte offset of a part as if parts were consecutive ranges (its
storage is its output's whatever the dim); the runtime (runtime/arena.py) reads `dim` and
`start`, where along the dim the part begins.
"""

from __future__ import annotations

from dataclasses import dataclass

from modulec.ir.graph import Function
from modulec.plan.in_place import readers_of


CONCATS = ("concat", "split_backward")  # split's derived backward concatenates d_parts
# views a part may be made through: the op's output is its input with two dims swapped
SWAPS = ("transpose", "transpose_backward")


@dataclass(frozen=True)
class Part:
    concat: str       # the concat's output value
    dim: int          # the dim it concatenates over (non-negative)
    start: int        # where along `dim` the part begins
    length: int       # its size along `dim`
    byte_offset: int  # its offset in the output read as consecutive ranges (the planner's)
    swaps: tuple = ()  # (dim0, dim1) swaps from the concat's slice to this buffer's view


def joined_parts(function: Function, own: set[str], size_of) -> dict[str, Part]:
    """{buffer: Part} of `function`'s concats planned in place. `own`: the values with
    transient buffers of their own an op made (not views, not written over an input, not
    saved, not results); `size_of(value)`: its bytes. A part that is a transpose of such a
    buffer (read by that transpose alone) puts the buffer there, transposed back."""
    readers = readers_of(function)
    producers = {o: n for n in function.nodes for o in n.outputs if o}
    joined: dict[str, Part] = {}
    for node in function.nodes:
        if node.kind != "op" or node.target not in CONCATS or not node.outputs[0]:
            continue
        parts = list(node.inputs)
        if node.outputs[0] not in own or len(parts) < 2 or len(set(parts)) != len(parts):
            continue
        buffers = [_buffer_of(p, node.id, own, readers, producers) for p in parts]
        if all(b is not None for b in buffers):
            joined.update(_parts(function, node, parts, buffers, size_of))
    return joined


def _buffer_of(part: str, reader: str, own: set, readers: dict, producers: dict):
    """(buffer, swaps) that holds `part`, read by `reader` alone, or None."""
    if readers.get(part) != [reader]:
        return None
    if part in own:
        return part, ()
    producer = producers.get(part)
    if producer is None or producer.kind != "op" or producer.target not in SWAPS:
        return None
    source = producer.inputs[0]
    if source not in own or readers.get(source) != [producer.id]:
        return None
    return source, ((int(producer.attr("dim0")), int(producer.attr("dim1"))),)


def _parts(function: Function, node, parts: list, buffers: list, size_of) -> dict[str, Part]:
    rank = len(function.value(node.outputs[0]).shape)
    dim = int(node.attr("dim", -1)) % rank
    joined, start, offset = {}, 0, 0
    for part, (buffer, swaps) in zip(parts, buffers):
        length = int(function.value(part).shape[dim])
        joined[buffer] = Part(node.outputs[0], dim, start, length, offset, swaps)
        start += length
        offset += size_of(buffer)
    return joined
