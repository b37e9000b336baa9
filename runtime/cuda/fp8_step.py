"""The GPU step's FP8 recipe (decisions.md, "FP8 on the GPU"): the program's
`metadata.precision` run as FP8 GEMMs (runtime/fp8_gemm.py) on the matmuls it lists.

`StepFp8` holds the recipe's sites and the device `ScaleState` (amax histories: training
state, saved in checkpoints as the CPU emulation's are); the step's interpreter asks
`run_op` for each covered matmul / matmul_backward node, with the emulation's operand keys
(runtime.fp8.covered), so a GPU run and a CPU run of one program keep the same histories.
What the GPU cannot run yet is refused when the step is made (runtime.fp8.refuse_on_gpu).
"""

from __future__ import annotations

from runtime import fp8_gemm
from runtime.fp8 import covered, refuse_on_gpu

TARGETS = ("matmul", "matmul_backward")


class StepFp8:
    def __init__(self, section: dict, device="cuda"):
        self.recipe = section["recipe"]
        self.sites = {(m["function"], m["op"]): m for m in section["matmuls"]}
        self.scales = fp8_gemm.ScaleState(self.recipe, device)

    def covers(self, function: str, op: str) -> bool:
        return (function, op) in self.sites

    def run_op(self, node, frame, forward, inputs: list, attrs: dict) -> list:
        """The outputs of covered `node` (inputs read, attrs the node's) in FP8."""
        plan = covered(self.sites, self.recipe, node, frame, forward)
        where = f"{frame.function.name}/{node.id} (recipe `{self.recipe['name']}`)"
        if node.target == "matmul":
            A, B = (fp8_gemm.Operand(v, fmt, key) for v, (fmt, key, _) in zip(inputs, plan))
            return [fp8_gemm.matmul(self.scales, A, B, where=where, **attrs)]
        d_C, A, B = inputs
        wanted = attrs.pop("wanted_outputs", (True, True))
        if d_C is None:  # no gradient reached C: none leaves either
            return [B.new_zeros(A.shape) if wanted[0] else None,
                    B.new_zeros(B.shape) if wanted[1] else None]
        d_C, A, B = (fp8_gemm.Operand(v, fmt, key) for v, (fmt, key, _) in zip(inputs, plan))
        return fp8_gemm.matmul_backward(self.scales, d_C, A, B, wanted=wanted, where=where,
                                        **attrs)

    # the step's calls
    def begin_step(self) -> None:
        self.scales.begin_step()
        self.scales.recording = True

    def end_step(self) -> None:
        self.scales.recording = False
        self.scales.end_step()

    def state_dict(self) -> dict:
        return self.scales.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.scales.load_state_dict(state)


def step_fp8(program, dist=None, device="cuda") -> StepFp8 | None:
    """The program's recipe on the GPU step (None without one); refused when it holds
    what the GPU cannot run. Under data / tensor parallel (`dist`) each rank scales by its
    own amaxes and keeps its own histories (not reduced across ranks: `modulec train`
    refuses a recipe under torchrun, its checkpoint would hold one rank's)."""
    section = program.metadata.get("precision")
    if not section:
        return None
    refuse_on_gpu(program.metadata)
    return StepFp8(section, device) if section["matmuls"] else None


def head_covered(fp8: StepFp8 | None, graph) -> bool:
    """The recipe covers the model's LM head (its `high_precision` leaves it out): the
    step then runs it as an FP8 GEMM, not through the fused bf16 head."""
    if fp8 is None:
        return False
    entry = graph.function(graph.entry)
    last = entry.nodes[-1] if entry.nodes else None
    return last is not None and fp8.covers(entry.name, last.id)
