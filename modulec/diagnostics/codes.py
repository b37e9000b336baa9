"""Every diagnostic code: its title (the specification's wording, Appendix C and D), its
severity, and an explanation for people (what it means, the usual cause, the fix). Codes
after the spec's (`OWN_CODES`: W006, W007) are this compiler's own.

This one table backs the tests that every emitted code is documented and covered by a UI
test (tests/test_codes.py), and `modulec explain CODE`. Titles are copied from the
specification's tables; explanations describe what this compiler checks.
"""

from __future__ import annotations

from dataclasses import dataclass

from modulec.diagnostics.diagnostic import Severity


@dataclass(frozen=True)
class CodeInfo:
    code: str
    title: str
    severity: Severity
    explanation: str
    spec: str = ""  # where the specification describes the rule ("§5.11.1"), if anywhere


def _e(code: str, title: str, explanation: str, spec: str = "") -> CodeInfo:
    return CodeInfo(code, title, Severity.ERROR, " ".join(explanation.split()), spec)


def _w(code: str, title: str, explanation: str, spec: str = "") -> CodeInfo:
    return CodeInfo(code, title, Severity.WARNING, " ".join(explanation.split()), spec)


_TABLE: tuple[CodeInfo, ...] = (
    # ------------------------------------------------------------------ errors (Appendix C)
    _e("E001", "Syntax error", """
        The file does not follow the grammar of the Module DSL, so it cannot be parsed. The
        message names the problem: a flow whose last `->` leads nowhere, a declaration or
        section header without its `:`, a bracket that is never closed (or a closer with no
        opener), indentation that is deeper than expected or matches no open block, a tab
        in indentation, a misspelled declaration keyword, a string without its closing
        `"` or written with single quotes, a character that starts nothing valid, or the
        specification's `...` placeholder copied into real code. Unknown section names
        (`forwrd:`) and graph statements written directly in a declaration instead of under
        `forward:`/`graph:` are reported with this code too. Fix the text at the marked
        position; the help line usually says what was expected there. Each broken line is
        skipped, so the rest of the file is still checked and further errors are real.""",
       "Appendix A"),
    _e("E002", "Undefined identifier", """
        A name is used that nothing in scope defines: a tensor that no earlier flow
        produces, a parameter or dimension that is not declared, or a module or primitive
        that is neither declared in this file nor imported. The usual cause is a typo or a
        missing `import`. Fix the spelling (the help line suggests close names), declare the
        name (as a module parameter, in `let:`, `params:` or as a graph input), or import
        the module that defines it.""", "§3, §4.7"),
    _e("E003", "Type mismatch", """
        A value has the wrong kind for the place it is used: a float where an `int` is
        required, a string where a dimension is expected, a tensor where a compile-time
        value is needed, or an argument that does not fit the declared type of a module or
        primitive parameter. Convert the value, pass a different one, or change the
        declared type.""", "§3"),
    _e("E004", "Shape mismatch", """
        Two tensor shapes that must agree do not: the inner dimensions of a matmul, the
        operands of an elementwise operation that cannot broadcast, or a tensor whose
        computed shape differs from the shape declared for it in `in:`/`out:` or
        `params:`. Check the order of the dimensions
        (a missing transpose is common), the parameters the shapes are written in, and the
        declared shapes.""", "§3.2, §5"),
    _e("E005", "Missing required gradient", """
        A backward graph does not compute the gradient of an input or parameter that needs
        one. Every differentiable input (`d_<input>`) and every trainable parameter
        (`d_<param>`) must be produced by `backward:`. Add the missing flow that computes
        it, or mark the parameter `@frozen` if it is not trained.""", "§5.12"),
    _e("E006", "Saved tensor not available in backward", """
        The backward graph reads `saved.<name>`, but `<name>` is not in the forward pass's
        `save:` list (or was never computed by the forward graph). Add the tensor to
        `save:`, or recompute it in the backward graph from tensors that are saved.""",
       "§5.10, §5.12"),
    _e("E007", "Circular dependency in graph", """
        The flows of a graph form a cycle: a tensor depends, directly or through other
        tensors, on itself. A graph must be acyclic so that it can be executed in order.
        Usually one flow reads the wrong tensor
        (often a later one with a similar name); rename it, or break the cycle by
        introducing a new tensor.""", "§5.11"),
    _e("E008", "Invalid annotation", """
        An `@annotation` is unknown, is given arguments it does not accept (or lacks
        required ones), or is attached to something it cannot apply to, such as a memory
        annotation on a parameter declaration. Check the name against the annotations of
        the specification and their argument lists, and move the annotation to the flow,
        tensor or declaration it is meant for.""", "§7"),
    _e("E009", "Duplicate parameter name", """
        The same name is declared twice: twice in a declaration's parameter list, or twice
        in its `params:` section. Each parameter needs a unique name; rename or remove
        one of them.""", "§4"),
    _e("E010", "Invalid weight mapping", """
        An entry of `hf_mapping:` or `hf_export:` cannot be applied: it names a parameter
        the model does not have, uses a `{layer}` placeholder where there are no layers, or
        its `fuse(...)`/`split(...)`/`transform(...)` does not fit the parameter (wrong
        dimension, ranges that do not cover the tensor, unknown transform). Check the
        internal parameter path against `params:` and the ranges against its shape.""",
       "§8"),
    _e("E011", "Incompatible inheritance", """
        A declaration `extends` a base it cannot extend: the base does not exist or is a
        different kind of declaration, an override changes the type or shape of an
        inherited parameter, or the derived declaration does not provide what an abstract
        base requires (such as its forward graph). Match the base's signature, or derive
        from a compatible base.""", "§4.2, §4.3"),
    _e("E012", "Missing required parameter", """
        A module, block or primitive is instantiated without a value for a parameter that
        has no default. Pass the missing argument (by position or by name), or give the
        parameter a default value in its declaration.""", "§4"),
    _e("E013", "Invalid fusion pattern", """
        A `@fuse(...)` annotation or `fusion:` entry names a pattern that is not known, or
        the operations it covers do not form that pattern (they are not adjacent in the
        graph, or an intermediate result is also used elsewhere). `modulec build` reports
        a request its `fuse` pass cannot apply: the flow lacks the pattern's operations, one
        of them is `@nofuse`, a value between them has a `modify` or `replace` hook, or the
        shapes do not fit (a broadcasting add is no residual add). Use one of the known
        patterns, list the operations in graph order, or remove the annotation and let the
        compiler decide.""", "§7.5"),
    _e("E014", "Unsupported primitive", """
        A primitive is used that the target cannot run: it has no implementation (`impl:`
        kernel) for this backend, or it is declared but not supported in this
        configuration. Use a supported primitive or composition of primitives, or provide
        an implementation for the primitive.""", "§6"),
    _e("E015", "Invalid dtype for operation", """
        An operation is given a tensor of a dtype it does not accept, for example an
        integer tensor to `softmax`, or an fp8 tensor to an operation without fp8 support.
        Cast the tensor first (an explicit `cast`), or change the dtype of the parameter or
        input it comes from.""", "§3, §7.4"),
    _e("E016", "`if` guard must be ConstExpr", """
        The condition of an `if` in a graph depends on something only known at run time,
        such as a tensor's value or a dynamic shape. Graph conditionals are resolved when
        the model is compiled, so the guard must be a compile-time expression built from
        module parameters and constants (`if use_bias:`). Turn the condition into a module
        parameter, or compute both branches and select between them with an operation.""",
       "§3.7, §5.6"),
    _e("E017", "Tensor redefinition in same scope (SSA violation)", """
        A tensor name is assigned twice in the same graph scope. Graphs are in single
        static assignment form: each name is produced by exactly one flow (the two branches
        of an `if` may each define the same name). Give the second result a new name
        (`x -> relu() -> x2`) and use that name afterwards.""", "§5.11.1"),
    _e("E018", "Gradient shape mismatch", """
        A gradient computed by the backward graph does not have the shape of the tensor it
        is the gradient of: `d_x` must have the shape of `x`. A missing transpose or a
        reduction over the wrong dimension is the usual cause.""", "§5.12"),
    _e("E019", "Circular gradient dependency", """
        The flows of a backward graph form a cycle: a gradient depends, through other
        tensors, on itself. Gradients must be computable in one backward sweep. Check which
        tensors each backward flow reads; usually one reads a gradient it should be
        producing.""", "§5.12"),
    _e("E020", "Gradient dtype incompatible", """
        A gradient has a dtype that cannot be used for the tensor it belongs to (for
        example an fp8 gradient for an fp32 master weight) and no explicit cast converts
        it. Add an explicit cast in the backward graph, or change the precision
        settings.""", "§5.12, §7.4"),
    _e("E021", "Recompute tensor not derivable from saved tensors", """
        A tensor is marked for recomputation (`@memory(recompute)` or in `recompute:`), but
        the flows that produce it need an input that is neither saved nor itself
        recomputable, so the backward pass could not rebuild it. Save one of the tensors
        it is derived from (add it to `save:`), or save the tensor itself instead of
        recomputing it.""", "§7.2"),
    _e("E022", "Circular recompute dependency", """
        Recomputing a tensor requires, through a chain of other recomputed tensors,
        recomputing that same tensor. Mark one tensor on the cycle as saved to break the
        cycle.""", "§7.2"),
    _e("E023", "Import name conflict", """
        Two imports bring the same name into the file (`import models.llama.Attention`
        and `import models.qwen.Attention` both define `Attention`), so uses of the name
        would be ambiguous. Import at least one of them under an alias
        (`import models.qwen.Attention as QwenAttention`), or refer to it by its qualified
        name.""", "§4.7.1"),
    _e("E024", "Import alias shadows existing name", """
        An import's `as` alias is a name that already means something in the file: a
        declaration, another import, or a primitive. An alias is chosen explicitly, so it
        must not hide anything. Pick a different alias.""", "§4.7.1"),
    _e("E025", "Checkpoint spans pipeline stages", """
        A `@checkpoint` region covers operations placed on different pipeline stages
        (different `@partition(...)` values). A checkpoint must be recomputed on one
        device, so its boundaries must align with the stage boundaries. Split the region
        into one checkpoint per stage.""", "§7.6"),
    _e("E026", "Invalid constraint expression", """
        An entry of a `constraint:` section is malformed: it needs a condition and a
        message (`C % H == 0, "C must be divisible by H"`), and the condition must be a
        compile-time boolean expression over the declaration's parameters and constants,
        not one that depends on tensors. Rewrite the condition, or add the missing
        message.""", "§3.5.1"),
    _e("E027", "Constraint violation", """
        A `constraint:` condition evaluated to false for the parameter values this
        declaration was instantiated with; the message is the one written with the
        constraint. Change the arguments (for example a dimension that must be divisible
        by the number of heads), or relax the constraint if it is wrong.""", "§3.5.1"),
    # ---------------------------------------------------------------- warnings (Appendix D)
    _w("W001", "User definition shadows primitive", """
        A declaration in this file has the name of a built-in primitive, so uses of that
        name now refer to the declaration, not to the primitive. This is allowed, but often
        unintended. Rename the declaration if the primitive was meant.""", "§4.7.1"),
    _w("W002", "Local definition shadows import", """
        A declaration in this file has the same name as something imported; the local
        declaration wins, and the import is unreachable under that name. Rename the
        declaration, or import under an alias.""", "§4.7.1"),
    _w("W003", "Suboptimal auto-derived backward", """
        The backward graph was derived automatically, but the derivation is likely slower
        or uses more memory than a hand-written one (for example it saves large
        intermediates, or cannot use a fused backward kernel). The result is correct.
        Write a `backward:` section if this module matters for performance.""", "§5.12.6"),
    _w("W004", "Unused saved tensor", """
        A tensor is listed in `save:` but the backward graph never reads
        `saved.<name>`, so keeping it costs memory for nothing. Remove it from
        `save:`.""", "§5.10"),
    _w("W005", "Implicit dtype narrowing", """
        A value is converted to a less precise dtype (for example fp32 to bf16) without an
        explicit cast, which can lose precision silently. Add an explicit cast if the
        narrowing is intended, or keep the wider dtype.""", "§7.4"),
    # ------------------------------------------------- this compiler's own (not in the spec)
    _w("W006", "Annotation has no effect on this backend yet", """
        An annotation (or one of its arguments) is valid, but the backend named in the
        message does not act on it yet: the CPU reference runtime, the GPU backend, or
        both. The program builds and runs as if the annotation were not there. The status
        of every annotation on each backend is the table in modulec/check/annotation_status.py
        and the page docs/annotations.md generated from it. A primitive's invariant that
        nothing checks (any but `backward_uses`, §9.8.3) is reported with this code too.
        Remove the annotation, or keep it for when the backend implements it.""", "§7"),
    _w("W007", "Lock file out of date", """
        The `module.lock` next to the checked file (written by `modulec lock`) does not
        match what the file's imports resolve to now: a module was edited since it was
        locked (its hash differs), another version is found, or the file imports a module
        the lock does not list. The program is checked and built from what the imports
        resolve to now, not from the lock. Run `modulec lock FILE` to lock the current
        modules, or restore the module the lock names.""", "§4.7"),
)

CODES: dict[str, CodeInfo] = {info.code: info for info in _TABLE}
OWN_CODES = ("W006", "W007")  # not in the specification's Appendix C / D


def lookup(code: str) -> CodeInfo | None:
    """The entry for `code` (case-insensitive, e.g. "e001"), or None if there is none."""
    return CODES.get(code.strip().upper())


def all_codes() -> list[CodeInfo]:
    """Every entry: errors E001... then warnings W001..., in order."""
    return list(_TABLE)
