"""FP8 precision recipes (spec §7.4.4) resolved into the IR: metadata `precision`.

A `recipe` declaration's settings become one recipe (`resolve`), the std recipe is
`STD_RECIPE` (`modulec train --precision fp8`; `--fp8-scaling`, `--fp8-gradient` and
`--fp8-history` change its scaling and gradient format: `std_recipe`). `@recipe(Name)` on
a declaration of the built file covers every `matmul` of the functions lowered from it
and of what they call; `precision_section` lists them, one entry per matmul op, with
the formats, scaling and granularity each one runs with, and the ops that stay in high
precision (the LM head: a covered matmul whose result is an output of the model;
embeddings and the loss are not matmuls and never take FP8). The CPU reference emulates
it (runtime/fp8.py); the GPU step runs the matmuls as FP8 GEMMs (runtime/fp8_gemm.py) and
refuses what it cannot run yet when it loads (runtime.fp8:refuse_on_gpu). decisions.md,
"FP8 recipes", "FP8 on the GPU".
"""

from __future__ import annotations

from modulec.diagnostics import Diagnostic, error, warning
from modulec.ir.graph import Graph, function_runs
from modulec.ops.registry import backward_gradients, op_table
from modulec.syntax import ast as A

FP8 = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}  # the formats and their largest finite values
SCALINGS = {"delayed": "delayed", "current": "current", "dynamic": "current"}
GRANULARITIES = ("per_tensor", "per_block")
HIGH_PRECISION = ("lm_head", "embedding", "loss")
BLOCK = 128  # per_block: activations and gradients 1 x 128, weights 128 x 128

STD_RECIPE = {"name": "std.FP8", "forward": "fp8_e4m3", "gradient": "fp8_e5m2",
              "accumulate": "fp32", "output": "bf16",
              "scaling": {"kind": "delayed", "history_len": 16, "margin": 0},
              "granularity": {"kind": "per_tensor"},
              "high_precision": list(HIGH_PRECISION)}

STD_OVERRIDES = ("scaling", "gradient", "history_len")  # what --fp8-* may change


def std_recipe(overrides: dict | None = None) -> dict:
    """STD_RECIPE as `--fp8-scaling` / `--fp8-gradient` / `--fp8-history` change it for one
    build: `scaling` delayed | current, `gradient` an FP8 format, `history_len` (delayed
    only, >= 1). None or {}: STD_RECIPE itself (the IR as without the options)."""
    if not overrides:
        return STD_RECIPE
    kind = overrides.get("scaling", STD_RECIPE["scaling"]["kind"])
    history = overrides.get("history_len", STD_RECIPE["scaling"]["history_len"])
    problem = next((m for bad, m in (
        (set(overrides) - set(STD_OVERRIDES), f"takes only {', '.join(STD_OVERRIDES)}"),
        (kind not in ("delayed", "current"), "`scaling` is delayed or current"),
        (overrides.get("gradient", "fp8_e5m2") not in FP8, "`gradient` is an FP8 format"),
        (not isinstance(history, int) or history < 1, "`history_len` is at least 1"),
        (kind == "current" and "history_len" in overrides,
         "`history_len` is for delayed scaling")) if bad), None)
    if problem:
        raise ValueError(f"the std FP8 recipe's overrides: {problem}")
    recipe = {k: (dict(v) if isinstance(v, dict) else v) for k, v in STD_RECIPE.items()}
    recipe["gradient"] = overrides.get("gradient", recipe["gradient"])
    recipe["scaling"] = {"kind": "delayed", "history_len": history, "margin": 0} \
        if kind == "delayed" else {"kind": "current", "margin": 0}
    recipe["high_precision"] = list(HIGH_PRECISION)
    return recipe


# setting -> (recipe field, allowed words or a kind)
_WORDS = {"forward_activation_dtype": ("forward", tuple(FP8)),
          "compute": ("forward", tuple(FP8)),
          "backward_gradient_dtype": ("gradient", tuple(FP8)),
          "accumulation_dtype": ("accumulate", ("fp32",)),
          "output_dtype": ("output", ("bf16", "fp32")),
          "weight_storage_dtype": ("storage", ("bf16", "fp32")),
          "scaling_strategy": ("scaling", tuple(SCALINGS)),
          "granularity": ("granularity", GRANULARITIES)}
_NUMBERS = {"amax_history_len": 1, "margin": 0, "amax_margin": 0}  # name -> least value


def resolve(decl: A.Decl) -> tuple[dict, list[Diagnostic]]:
    """The recipe a `recipe` declaration says, over STD_RECIPE's defaults, and E008 for a
    setting that is unknown or has a value the recipe cannot take."""
    found, problems = {}, []
    for item in decl.body:
        if not isinstance(item, A.Entry) or not isinstance(item.key, A.Name):
            continue
        key, value = item.key.id, item.value
        problem = _setting(key, value, found)
        if problem:
            problems.append(error("E008", f"recipe `{decl.name}`: {problem}", item.span,
                                  "this setting", help=[_known()]))
    if found.get("granularity") == "per_block" and \
            SCALINGS[found.get("scaling", "current")] == "delayed":
        problems.append(error("E008", f"recipe `{decl.name}`: per-block scaling takes "
                              "each block's own amax (`scaling_strategy: current`), not "
                              "a delayed history", decl.name_span, "this recipe",
                              help=["add `scaling_strategy: current`"]))
    problems += _without_effect(decl, found)
    return _recipe(decl.name, found), problems


# settings that are recorded (for the GPU step to come) but change nothing yet: W006
_NOT_YET = {
    "weight_storage_dtype": "trainers keep fp32 master weights (the GPU step a bf16 compute "
                            "copy); FP8 weight storage is not built",
    "output_dtype": "the CPU reference computes every op in float32 / float64; the GPU "
                    "step's FP8 GEMMs write its compute dtype (bf16)",
}


def _without_effect(decl: A.Decl, found: dict) -> list[Diagnostic]:
    notes = []
    for item in decl.body:
        key = item.key.id if isinstance(item, A.Entry) and isinstance(item.key, A.Name) \
            else None
        if key in _NOT_YET:
            notes.append(warning("W006", f"recipe setting `{key}` has no effect yet",
                                 item.span, "no effect yet", notes=[_NOT_YET[key]]))
        if key == "high_precision" and {"embedding", "loss"} - set(found.get(key, ())):
            notes.append(warning("W006", "embeddings and the loss stay in high precision "
                                 "whatever `high_precision` says", item.span,
                                 "no effect yet", notes=["only matmuls take FP8; an "
                                                         "embedding lookup or the loss in "
                                                         "FP8 is not built"]))
    return notes


def _setting(key: str, value, found: dict) -> str:
    if key in _WORDS:
        field, words = _WORDS[key]
        word = value.id if isinstance(value, A.Name) else \
            value.value if isinstance(value, A.String) else None
        if word not in words:
            return f"`{key}` takes one of {', '.join(words)}"
        found[field] = word
    elif key in _NUMBERS:
        number = value.value if isinstance(value, A.Number) else None
        if not isinstance(number, int) or number < _NUMBERS[key]:
            return f"`{key}` takes a whole number of at least {_NUMBERS[key]}"
        found["history_len" if key == "amax_history_len" else "margin"] = number
    elif key == "high_precision":
        names = [i.id for i in value.items if isinstance(i, A.Name)] \
            if isinstance(value, A.ListExpr) else None
        if names is None or len(names) != len(value.items) or \
                any(n not in HIGH_PRECISION for n in names):
            return f"`high_precision` takes a list of {', '.join(HIGH_PRECISION)}"
        found["high_precision"] = names
    else:
        return f"unknown setting `{key}`"
    return ""


def _known() -> str:
    return "settings: " + ", ".join(f"`{k}`" for k in (*_WORDS, *_NUMBERS, "high_precision"))


def _recipe(name: str, found: dict) -> dict:
    recipe = {k: (dict(v) if isinstance(v, dict) else v) for k, v in STD_RECIPE.items()}
    recipe["name"] = name
    for key in ("forward", "gradient", "accumulate", "output"):
        recipe[key] = found.get(key, recipe[key])
    kind = SCALINGS[found.get("scaling", "delayed")]
    recipe["scaling"] = {"kind": kind, "margin": found.get("margin", 0)} | \
        ({"history_len": found.get("history_len", 16)} if kind == "delayed" else {})
    if found.get("granularity") == "per_block":
        recipe["granularity"] = {"kind": "per_block", "activation": [1, BLOCK],
                                 "weight": [BLOCK, BLOCK], "gradient": [1, BLOCK]}
    recipe["high_precision"] = found.get("high_precision", list(HIGH_PRECISION))
    return recipe


# ====================================================================== which decls
def recipe_names(program: A.Program) -> dict[str, tuple[str, A.Annotation]]:
    """Declaration name -> (the recipe its `@recipe(Name)` names, the annotation)."""
    named = {}
    for decl in program.decls:
        notes = list(decl.annotations) + [n for item in decl.body
                                          if isinstance(item, A.AnnotationLine)
                                          for n in item.annotations]
        for note in notes:
            if note.name == "recipe" and note.args and isinstance(note.args[0].value, A.Name):
                named[decl.name] = (note.args[0].value.id, note)
    return named


def program_recipe(program: A.Program, model: str, std: bool, overrides: dict | None = None):
    """(recipe, covered declaration names, diagnostics) for building `model` of
    `program`: `std` (--precision fp8) applies STD_RECIPE (with the --fp8-* `overrides`:
    std_recipe) to the model; else the `@recipe(...)` of the file's declarations (one
    recipe per build). None: no recipe."""
    if std:
        return std_recipe(overrides), {model}, []
    named = recipe_names(program)
    if not named:
        return None, set(), []
    decls = {d.name: d for d in program.decls if d.kind == "recipe"}
    chosen = sorted({name for name, _ in named.values()})
    first = next(iter(named.values()))[1]
    if len(chosen) > 1:
        return None, set(), [error("E008", "one build takes one precision recipe; this file "
                                   f"applies {', '.join(f'`{c}`' for c in chosen)}",
                                   first.span, "one of them")]
    if chosen[0] not in decls:
        return None, set(), [error("E008", f"recipe `{chosen[0]}` is not declared in this "
                                   "file: an imported recipe is not resolved yet",
                                   first.span, "declare the recipe here")]
    recipe, problems = resolve(decls[chosen[0]])
    return recipe, set(named), problems


# ====================================================================== the IR section
def precision_section(graph: Graph, recipe: dict, covered: set[str]) -> dict | None:
    """metadata `precision`: the recipe, each covered matmul ({function, op, operands,
    role: forward, backward or recompute}) and the matmuls kept in high precision ({function, op, why})."""
    matmuls, kept = [], []
    reached = _covered_functions(graph, covered)
    entry = graph.function(graph.entry)
    for function in graph.functions:
        source = graph.function(function.gradient_of) if function.gradient_of else function
        if source.name not in reached:
            continue
        for node in function.nodes:
            if node.kind != "op" or node.target not in ("matmul", "matmul_backward"):
                continue
            site = {"function": function.name, "op": node.id}
            if _lm_head(node, function, entry):
                if "lm_head" in recipe["high_precision"]:
                    kept.append(site | {"why": "lm_head"})
                    continue
            matmuls.append(site | _roles(node, function))
    if not matmuls and not kept:
        return None
    return {"recipe": recipe, "matmuls": matmuls, "high_precision": kept}


def _covered_functions(graph: Graph, covered: set[str]) -> set[str]:
    reached: set[str] = set()
    for function in graph.functions:
        if function.module in covered and not function.gradient_of:
            reached |= {f.name for f, _ in function_runs(graph, function)}
    return reached


def _lm_head(node, function, entry) -> bool:
    """The model's own matmul making one of its outputs (logits), or its backward."""
    if function.name == entry.name:
        return any(o in entry.outputs for o in node.outputs)
    if function.gradient_of == entry.name and node.target == "matmul_backward":
        origin = node.attr("forward_node")
        op = next((n for n in entry.nodes if n.id == origin), None)
        return op is not None and any(o in entry.outputs for o in op.outputs)
    return False


def _roles(node, function) -> dict:
    """A forward matmul quantizes both operands to the forward format; a derived backward
    (`matmul_backward`) the incoming gradient to the gradient format and the saved
    operands as in the forward; a matmul written in a backward function, each operand
    that is a gradient (depends on the function's gradient inputs) to the gradient format."""
    if node.target == "matmul_backward":
        return {"role": "backward", "operands": ["gradient", "forward", "forward"]}
    if not function.gradient_of:
        return {"role": "forward", "operands": ["forward", "forward"]}
    tainted = _gradient_values(function)
    roles = ["gradient" if v in tainted else "forward" for v in node.inputs]
    return {"role": "backward" if "gradient" in roles else "recompute", "operands": roles}


def _gradient_values(function) -> set[str]:
    """Values of a written backward function that depend on its gradient inputs (`d_*`).
    A primitive backward's outputs that are no gradient do not: swiglu_backward's `y` is
    the forward's output, made from gate and up alone (a forward operand)."""
    tainted = {i.id for i in function.inputs if (i.name or i.id).startswith("d_")}
    for node in function.nodes:
        if any(v in tainted for v in node.inputs):
            tainted |= {o for o, gradient in zip(node.outputs, _gradient_outputs(node))
                        if o and gradient}
    return tainted


def _gradient_outputs(node) -> list[bool]:
    """Per output of `node`, whether it can carry a gradient: all of them, but for a
    primitive's backward op, the outputs its signature names `d_*` (backward_gradients)."""
    if node.kind == "op" and node.target.endswith("_backward"):
        rule = op_table().get(node.target[:-len("_backward")])
        flags = backward_gradients(rule) if rule is not None else ()
        if len(flags) == len(node.outputs):
            return list(flags)
    return [True] * len(node.outputs)


# ====================================================================== ir verify
def section_problems(section, graph: Graph) -> list[str]:
    """`ir verify`: the section names matmul ops of the graph, each once, with operand
    roles of the right count, and a recipe whose formats and scaling are known."""
    if not isinstance(section, dict) or not isinstance(section.get("recipe"), dict):
        return ["metadata: `precision` must be an object with a `recipe`"]
    problems = _recipe_problems(section["recipe"])
    nodes = {(f.name, n.id): n for f in graph.functions for n in f.nodes}
    seen = set()
    for entry in list(section.get("matmuls", [])) + list(section.get("high_precision", [])):
        key = (entry.get("function"), entry.get("op")) if isinstance(entry, dict) else None
        node = nodes.get(key)
        if node is None or node.target not in ("matmul", "matmul_backward"):
            problems.append(f"metadata: `precision` names {key}, not a matmul of the graph")
        elif key in seen:
            problems.append(f"metadata: `precision` names {key} twice")
        elif "operands" in entry and (len(entry["operands"]) != len(node.inputs) or any(
                r not in ("forward", "gradient") for r in entry["operands"])):
            problems.append(f"metadata: `precision` gives {key} operand roles "
                            f"{entry['operands']} for {len(node.inputs)} inputs")
        seen.add(key)
    return problems


def _recipe_problems(recipe: dict) -> list[str]:
    scaling, grain = recipe.get("scaling") or {}, recipe.get("granularity") or {}
    checks = [(recipe.get("forward") in FP8, "`forward` is not an FP8 format"),
              (recipe.get("gradient") in FP8, "`gradient` is not an FP8 format"),
              (scaling.get("kind") in ("delayed", "current"), "scaling kind is unknown"),
              (isinstance(scaling.get("margin"), int) and scaling["margin"] >= 0,
               "scaling margin must be a whole number >= 0"),
              (scaling.get("kind") != "delayed" or (isinstance(
                  scaling.get("history_len"), int) and scaling["history_len"] >= 1),
               "delayed scaling needs history_len >= 1"),
              (grain.get("kind") in GRANULARITIES, "granularity is unknown")]
    return [f"metadata: `precision.recipe`: {message}" for ok, message in checks if not ok]
