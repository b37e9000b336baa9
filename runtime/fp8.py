"""FP8 emulation on the CPU reference: a program's `metadata.precision` (an FP8 recipe,
modulec/lower/fp8_recipe.py) acted on by the interpreter (decisions.md, "FP8 recipes").

Each covered matmul's operands are quantized and dequantized before the matmul runs in the
reference's dtype: x * scale clamped to +-fp8_max (saturation), cast to torch's float8
dtype (round to nearest even, subnormals), back, / scale. Scales come from amaxes:
scale = fp8_max / amax / 2^margin; current scaling reads the tensor's own amax, delayed
scaling the maximum of the operand's amax history (the last `history_len` steps; the
tensor's own while the history is empty). `Fp8State` holds the histories (model state:
saved in training checkpoints) and the amaxes of the step under way, pushed by `end_step`.
The GPU step runs the same recipes as FP8 GEMMs (runtime/fp8_gemm.py) with the same
operand keys (`covered`) and refuses what it cannot run yet (`refuse_on_gpu`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from runtime.errors import RuntimeUserError

FORMATS = {"fp8_e4m3": (torch.float8_e4m3fn, 448.0), "fp8_e5m2": (torch.float8_e5m2, 57344.0)}
GPU_REFUSAL = "FP8 on the GPU step does not run this yet"


def refuse_on_gpu(metadata: dict) -> None:
    """What the GPU step's FP8 GEMMs (runtime/fp8_gemm.py) cannot run is refused when the
    program loads, never run in bf16 in silence: per-block scaling, and a product of two
    E5M2 operands (cuBLAS has no E5M2 x E5M2 GEMM)."""
    section = metadata.get("precision")
    if not section:
        return
    recipe = section["recipe"]
    if recipe["granularity"]["kind"] != "per_tensor":
        raise RuntimeUserError(
            f"{GPU_REFUSAL}: the FP8 recipe `{recipe['name']}` scales per block "
            f"({recipe['granularity']['kind']}); the GPU step's FP8 GEMMs scale per tensor",
            help=["train it on the CPU reference (`--device cpu`), which emulates per-block "
                  "scaling, or use `granularity: per_tensor` for the GPU step"])
    for site in section["matmuls"]:
        formats = [recipe["gradient"] if r == "gradient" else recipe["forward"]
                   for r in site["operands"]]
        pairs = [(formats[0], f) for f in formats[1:]] if site.get("role") == "backward" \
            and len(formats) == 3 else [tuple(formats)]
        if ("fp8_e5m2", "fp8_e5m2") in pairs:
            raise RuntimeUserError(
                f"{GPU_REFUSAL}: the FP8 recipe `{recipe['name']}` multiplies two E5M2 "
                f"operands in {site['function']}/{site['op']}; cuBLAS has no E5M2 x E5M2 "
                "GEMM", help=["use `forward_activation_dtype: fp8_e4m3` (E5M2 for the "
                              "gradients only), or train on the CPU reference"])


# ====================================================================== numerics
def scale_for(amax: float, fmt: str, margin: int = 0) -> float:
    """fp8_max / amax / 2^margin; 1 for an amax of 0 or one not finite."""
    if not math.isfinite(amax) or amax <= 0.0:
        return 1.0
    return FORMATS[fmt][1] / amax / 2.0 ** margin


def quantize(x: Tensor, fmt: str, scale) -> Tensor:
    """x rounded to `fmt` at `scale` (a number or a tensor broadcasting against x) and
    back, in x's dtype: saturating at +-fp8_max, NaN kept."""
    dtype, top = FORMATS[fmt]
    scaled = (x * scale).clamp(-top, top)  # clamp keeps NaN; the casts would not saturate
    return scaled.to(dtype).to(x.dtype) / scale


def quantize_blocks(x: Tensor, fmt: str, block: tuple[int, int], margin: int = 0) -> Tensor:
    """Per-block current scaling over the stored matrix (leading dims folded into rows):
    each `block` = (rows, cols) tile of its own amax, the last tiles partial."""
    matrix = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    rows, cols = matrix.shape
    br, bc = block
    pad_r, pad_c = -rows % br, -cols % bc
    padded = torch.nn.functional.pad(matrix, (0, pad_c, 0, pad_r))
    tiles = padded.reshape((rows + pad_r) // br, br, (cols + pad_c) // bc, bc)
    amax = tiles.abs().amax(dim=(1, 3), keepdim=True)
    top = FORMATS[fmt][1]
    scale = torch.where((amax > 0) & torch.isfinite(amax), top / amax / 2.0 ** margin,
                        torch.ones_like(amax))
    out = quantize(tiles, fmt, scale).reshape(rows + pad_r, cols + pad_c)
    return out[:rows, :cols].reshape(x.shape)


# ====================================================================== the state
class Fp8State:
    """The recipe of a program's `metadata.precision` and its amax histories, by operand
    key (`layer path|function/op:operand`)."""

    def __init__(self, section: dict):
        self.recipe = section["recipe"]
        self.sites = {(m["function"], m["op"]): m for m in section["matmuls"]}
        scaling = self.recipe["scaling"]
        self.kind, self.margin = scaling["kind"], int(scaling.get("margin", 0))
        self.history_len = int(scaling.get("history_len", 1))
        self.histories: dict[str, list[float]] = {}
        self.pending: dict[str, float] = {}  # this step's amax per operand so far
        # a trainer records during its step's passes only: an evaluation or inference
        # forward between steps reads the histories but adds nothing to them
        self.recording = False

    def site(self, function: str, op: str) -> dict | None:
        return self.sites.get((function, op))

    def fake_quantize(self, x: Tensor, fmt: str, key: str, weight: bool) -> Tensor:
        """x through `fmt` as the recipe scales it; its amax recorded for the step."""
        if not x.is_floating_point():
            return x
        grain = self.recipe["granularity"]
        if grain["kind"] == "per_block":
            which = "weight" if weight else "activation"
            return quantize_blocks(x, fmt, tuple(grain[which]), self.margin)
        amax = float(x.detach().abs().max()) if x.numel() else 0.0
        if self.recording and not math.isnan(amax):
            self.pending[key] = max(self.pending.get(key, 0.0), amax)
        history = self.histories.get(key)
        if self.kind == "delayed" and history:
            amax = max(history)
        return quantize(x, fmt, scale_for(amax, fmt, self.margin))

    def end_step(self) -> None:
        """Close a training step: each operand's amax of the step joins its history."""
        for key, amax in self.pending.items():
            history = self.histories.setdefault(key, [])
            history.append(amax)
            del history[:-self.history_len]
        self.pending = {}

    def state_dict(self) -> dict[str, Tensor]:
        """The histories as float64 tensors (a checkpoint's `fp8.<key>`)."""
        return {key: torch.tensor(h, dtype=torch.float64) for key, h in self.histories.items()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        self.histories = {key: [float(v) for v in t.tolist()] for key, t in state.items()}
        self.pending = {}


# ====================================================================== in the interpreter
def operands(state: Fp8State, node, frame, forward, inputs: list) -> list:
    """The inputs of matmul (forward) or matmul_backward `node` quantized as its site in
    the recipe says; the inputs unchanged where the recipe does not cover it."""
    plan = covered(state.sites, state.recipe, node, frame, forward)
    if plan is None:
        return inputs
    return [value if value is None else state.fake_quantize(value, fmt, key, weight)
            for value, (fmt, key, weight) in zip(inputs, plan)]


def covered(sites: dict, recipe: dict, node, frame, forward) -> list | None:
    """None where the recipe does not cover matmul / matmul_backward `node` (in `frame`);
    else per input (its format, its amax history's key, whether it is a weight). Keys:
    `layer path[indices]|function/op:operand`, a derived backward's A and B at their
    forward op's keys (0, 1), its d_C at `grad` (the GPU step uses the same keys)."""
    site = sites.get((frame.function.name, node.id))
    if site is None:
        return None
    if node.target == "matmul_backward" and node.attr("forward_node") is not None \
            and forward is not None:
        function, op = forward.function.name, node.attr("forward_node")
    else:
        function, op = frame.function.name, node.id
    where = f"{frame.path}{list(frame.indices)}|{function}/{op}"
    if node.target == "matmul_backward":  # (d_C, A, B): A and B at their forward keys
        keys, weights = ("grad", 0, 1), (False, False, _is_param(node.inputs[2]))
    else:
        keys = tuple(range(len(node.inputs)))
        weights = tuple(_is_param(v) for v in node.inputs)
    return [(recipe["gradient"] if role == "gradient" else recipe["forward"],
             f"{where}:{key}", weight)
            for role, key, weight in zip(site["operands"], keys, weights)]


def _is_param(value: str) -> bool:
    return value.startswith("param:")
