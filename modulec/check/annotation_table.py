"""Every annotation of spec §7 and §5.11, as data: placements, parameters, kinds, defaults.

`modulec.check.annotations` validates annotations against this table and takes every
message from it; nothing there knows an annotation by name. A parameter's `kind` says
which syntax it accepts (`Kind.nodes`) and, for enum-like kinds, which bare identifiers
(`Kind.choices`). Departures from the spec are recorded in docs/decisions.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from modulec.check.annotation_status import STATUS, Status
from modulec.syntax import ast as A

REQUIRED = object()  # `Param.default` of a parameter that must be given

# ====================================================================== placements
PLACEMENTS = {
    "param": "a parameter",
    "input": "an input tensor",
    "output": "a flow's output tensor",
    "op": "an operation in a flow",
    "decl": "a declaration header",
    "body_line": "a line of its own in a declaration body (or after a section's `:`)",
}
TENSOR = frozenset({"output", "op"})        # spec `tensor_output` (`op`: its unnamed output)
OPERATION = frozenset({"op", "output"})     # spec `operation`: written after the op or flow
BLOCK = frozenset({"decl", "body_line"})    # spec `block`, `subgraph`, `layer`, `graph`
PARAM = frozenset({"param"})
INPUT = frozenset({"input"})

# ====================================================================== value sets
DTYPES = ("bf16", "fp32", "fp16", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1", "int8", "int32", "int4")
HOOK_POINTS = {  # §7.3.1: standard hook points (any other identifier is a custom point)
    "AfterEmbedding": "after token embedding",
    "AfterQKVProjection": "after QKV linear",
    "AfterQKNorm": "after QK normalization",
    "BeforeAttention": "before flash attention",
    "AfterAttention": "after attention output",
    "AfterAttnOutProjection": "after output projection",
    "BeforeResidualAdd": "before residual connection",
    "AfterResidualAdd": "after residual connection",
    "AfterMLPUpProjection": "after MLP up/gate projection",
    "AfterMLPActivation": "after activation function",
    "AfterMLPDownProjection": "after MLP down projection",
    "AfterRouterProjection": "after MoE router",
    "BeforeExpertCompute": "before MoE experts",
    "AfterExpertCompute": "after MoE experts",
    "BeforeLMHead": "before language model head",
    "AfterLMHead": "after LM head (logits)",
}
FUSION_PATTERNS = {  # §7.5.1: pattern -> the operations it fuses
    "residual_norm": "Add + RMSNorm",
    "residual_layernorm": "Add + LayerNorm",  # not in the table: its LayerNorm twin
    "norm_linear": "RMSNorm + Linear",
    "gated_mlp": "Split + SwiGLU",
    "attention_softmax": "Scale + Softmax + Dropout",
    "bias_activation": "Add(bias) + Activation",
    "linear_bias_act": "Matmul + Bias + Activation",
}
PRECISION_POLICIES = {  # §7.4.2: policy -> (compute, accumulate, output)
    "fp32": ("fp32", "fp32", "fp32"),
    "bf16": ("bf16", "fp32", "bf16"),
    "fp16": ("fp16", "fp32", "fp16"),
    "fp8_hybrid": ("fp8_e4m3", "fp32", "bf16"),
    "fp8_pure": ("fp8_e4m3", "fp32", "fp8_e4m3"),
    "fp4": ("fp4_e2m1", "fp32", "bf16"),
}


# ====================================================================== kinds
@dataclass(frozen=True)
class Kind:
    """What a parameter accepts.

    nodes: the syntax accepted (a `Name` stands for a ConstExpr such as a module parameter,
    except in enum-like kinds, where it must be one of `choices`); number: "int" when a
    number literal must be integral; items/length: the element kind (and arity) of a list
    or tuple; hints: known values outside which anything goes, except a value within two
    edits of a known one (`near`: an E008 error, a misspelling); registry: the names must
    be known to the checker ("ops"); code/unknown/label: the code, message and label for a
    value outside `choices` or the registry. A registry's names are those of the
    annotation's site (`check_annotations`): "ops", "recipes", "kernels" (of the primitives
    the annotation is on), a string's text standing for its value.
    """

    describe: str
    nodes: tuple[type, ...]
    choices: tuple[str, ...] = ()
    number: str | None = None
    items: "Kind | None" = None
    length: int | None = None
    hints: tuple[str, ...] = ()
    registry: str | None = None
    code: str = "E008"
    unknown: str = "`{value}` is not a valid `{param}` for `@{annotation}`"
    label: str = "not a valid `{param}`"
    near: str = "`{value}` looks like a misspelling of `{guess}`"


_CONST = (A.Name, A.Number, A.Binary, A.Unary, A.Call, A.Attribute, A.Index, A.IfExp)
_BOOLISH = (A.Bool, A.Name, A.Compare, A.Unary, A.Binary, A.Call, A.Attribute)


def enum(*choices: str) -> Kind:
    return Kind("one of " + ", ".join(choices), (A.Name,), choices=choices)


INT = Kind("an integer", _CONST, number="int")
FLOAT = Kind("a number", _CONST)
BOOL = Kind("`true` or `false`", _BOOLISH)
STRING = Kind('a string (`"..."`)', (A.String,))
IDENT = Kind("a name", (A.Name, A.String))
EXPR = Kind("an expression", (object,))
DTYPE = Kind("a dtype", (A.Name,), choices=DTYPES)
HOOK_POINT = Kind("a hook point", (A.Name, A.String), hints=tuple(HOOK_POINTS),
                  near="`{value}` looks like a misspelling of the standard hook point `{guess}`")
NAMES = Kind("a list of names (`[a, b]`)", (A.ListExpr, A.Name), items=IDENT)
INT_PAIR = Kind("a pair of integers (`(32, 32)`)", (A.TupleExpr, A.Name), items=INT, length=2)
FUSION_PATTERN = Kind("a fusion pattern", (A.Name,), choices=tuple(FUSION_PATTERNS),
                      code="E013", unknown="unknown fusion pattern `{value}`")
OP = Kind("an operation name", (A.Name,), registry="ops", code="E013",
          unknown="`{value}` in `@{annotation}({param}=[...])` is neither a primitive "
                  "nor a known operation", label="unknown operation")
RECIPE = Kind("a recipe name", (A.Name,), registry="recipes",
              unknown="unknown recipe `{value}`", label="no recipe of this name")
KERNEL = Kind('a kernel name (`"cudnn"`)', (A.String,), registry="kernels",
              unknown="no kernel `{value}` for {where}",
              label="unknown kernel")
OPS = Kind("a list of operation names (`[matmul, add]`)", (A.ListExpr,), items=OP)
SIZES = Kind("a list of sizes (`[num_heads, num_kv_heads]`) or a `let` naming one",
             (A.ListExpr, A.Name), items=INT)


# ====================================================================== annotations
@dataclass(frozen=True)
class Param:
    name: str
    kind: Kind
    summary: str
    default: object = REQUIRED  # REQUIRED, None (may be `None`), or the default as written
    positional: bool = False    # may be given without `name=` (in table order)

    @property
    def required(self) -> bool:
        return self.default is REQUIRED


@dataclass(frozen=True)
class OneOf:
    """At least one of `params` must be given, unless `unless` (param, value) is."""

    params: tuple[str, ...]
    message: str
    code: str = "E008"
    unless: tuple[str, str] | None = None


@dataclass(frozen=True)
class Spec:
    name: str
    section: str
    summary: str
    placements: frozenset[str]
    params: tuple[Param, ...] = ()
    one_of: OneOf | None = None
    forms: tuple[str, ...] = field(default=())  # usage lines as the spec writes them
    # what a bare name in an annotation without positional parameters may have meant:
    # (where its names come from: a parameter's choices or a registry, what one is, what
    # they are, the form to write it in): `@precision(bf16)` -> `@precision(policy=bf16)`
    bare: tuple[tuple[str, str, str, str], ...] = ()
    status: Status | None = None  # what it does per backend (annotation_status.STATUS)

    def param(self, name: str) -> Param | None:
        return next((p for p in self.params if p.name == name), None)

    @property
    def positional(self) -> tuple[Param, ...]:
        return tuple(p for p in self.params if p.positional)


def req(name, kind, summary) -> Param:
    return Param(name, kind, summary, REQUIRED, positional=True)


def pos(name, kind, summary, default) -> Param:
    return Param(name, kind, summary, default, positional=True)


def opt(name, kind, summary, default=None) -> Param:
    return Param(name, kind, summary, default)


_SPECS = (
    # §7.2 memory ------------------------------------------------------------------
    Spec("memory", "§7.2.1", "controls a tensor's memory lifecycle", TENSOR | PARAM | INPUT, (
        req("mode", enum("save", "recompute", "temporary", "pin", "offload", "stream"),
            "memory lifecycle mode"),
        opt("priority", INT, "offload priority (lower = offload first)", "0"),
        opt("prefetch", BOOL, "prefetch before use if offloaded", "true"),
        opt("async", BOOL, "use async memory operations", "true"),
    ), forms=("@memory(mode)", "@memory(mode, options...)")),
    Spec("checkpoint", "§7.2.2", "marks an activation-checkpointing boundary",
         OPERATION | BLOCK, (
             pos("granularity", enum("full", "selective", "none"), "checkpoint level", "full"),
             opt("preserve", NAMES, "tensors saved even within the checkpoint", "[]"),
         ), forms=("@checkpoint", "@checkpoint(granularity=level)")),
    Spec("lifetime", "§7.2.3", "states a tensor's lifetime scope", TENSOR, (
        pos("scope", enum("operation", "sublayer", "block", "layer", "global"),
            "lifetime scope", "operation"),
        opt("start", IDENT, "operation where the lifetime begins"),
        opt("end", IDENT, "operation where the lifetime ends"),
    ), forms=("@lifetime(scope)", "@lifetime(start=op_name, end=op_name)")),
    # §7.3 hooks -------------------------------------------------------------------
    Spec("hook", "§7.3.1", "registers a named hook point", TENSOR, (
        req("point", HOOK_POINT, "hook point name"),
        opt("mode", enum("observe", "modify", "replace"), "what the hook may do", "observe"),
        opt("priority", INT, "execution order when several hooks", "0"),
    ), forms=("@hook(HookPoint)", "@hook(HookPoint, mode=mode)")),
    Spec("adapter", "§7.3.2", "declares an adapter injection point (LoRA, IA3, ...)", TENSOR, (
        req("type", enum("lora", "ia3", "prefix", "prompt", "adapter"), "adapter type"),
        opt("rank", INT, "LoRA rank", "16"),
        opt("alpha", FLOAT, "LoRA alpha", "32.0"),
        opt("dropout", FLOAT, "LoRA dropout", "0.0"),
        opt("targets", NAMES, "parts of a fused projection (e.g. `[q, k, v]`)", "[]"),
        opt("length", INT, "prefix/prompt length", "10"),
        opt("hidden_dim", INT, "prefix hidden dimension"),
        opt("bottleneck_dim", INT, "bottleneck adapter dimension", "64"),
        opt("activation", enum("relu", "gelu", "silu"), "bottleneck activation", "relu"),
    ), forms=("@adapter(type, params...)",)),
    Spec("probe", "§7.3.3", "inserts a debugging probe", TENSOR, (
        req("name", STRING, "probe identifier"),
        opt("capture", enum("stats", "histogram", "sample", "full", "grad_stats", "grad_full"),
            "what to capture", "stats"),
        opt("condition", STRING, "only capture when this condition holds"),
        opt("frequency", INT, "capture every N iterations", "1"),
    ), forms=("@probe(name)", "@probe(name, capture=what)")),
    # §7.4 precision ---------------------------------------------------------------
    Spec("dtype", "§7.4.1", "sets a tensor's data type", TENSOR | PARAM | INPUT, (
        req("type", DTYPE, "data type"),
    ), forms=("@dtype(type)",)),
    Spec("precision", "§7.4.2", "sets compute, accumulation and output precision",
         OPERATION | PARAM, (
             opt("compute", DTYPE, "computation dtype"),
             opt("accumulate", DTYPE, "accumulation dtype", "fp32"),
             opt("output", DTYPE, "output dtype"),
             opt("policy", enum(*PRECISION_POLICIES), "named precision policy"),
             opt("storage", DTYPE, "storage dtype of a parameter (§7.1 example)"),
         ), forms=("@precision(compute=dtype, accumulate=dtype, output=dtype)",
                   "@precision(policy=name)"),
         bare=(("policy", "a precision policy", "precision policies",
                "`@precision(policy={name})`"),
               ("recipes", "a recipe", "recipes",
                "`@recipe({name})` (on a line of its own in the declaration)"))),
    Spec("scaling", "§7.4.3", "sets the FP8/FP4 quantization scaling strategy",
         OPERATION | PARAM, (
             req("strategy", enum("per_tensor", "per_channel", "per_token", "per_block",
                                  "delayed", "dynamic"), "scaling strategy"),
             opt("history_len", INT, "amax history length", "16"),
             opt("update_interval", INT, "steps between scale updates", "1"),
             opt("block_size", INT_PAIR, "2D block dimensions", "(32, 32)"),
             opt("margin", FLOAT, "headroom margin", "0.0"),
         ), forms=("@scaling(strategy, params...)",)),
    Spec("recipe", "§7.4.4", "applies a precision recipe to the whole declaration", BLOCK, (
        req("name", RECIPE, "recipe name (a `recipe` declaration)"),
    ), forms=("@recipe(RecipeName)",)),
    # §7.5 fusion ------------------------------------------------------------------
    Spec("fuse", "§7.5.1", "suggests fusing operations into one kernel", OPERATION, (
        pos("pattern", FUSION_PATTERN, "named fusion pattern", None),
        opt("ops", OPS, "explicit operation list"),
        opt("scope", enum("local", "global"), "fusion scope", "local"),
    ), one_of=OneOf(("pattern", "ops"), "`@fuse` needs a fusion pattern or `ops=[...]`",
                    code="E013", unless=("scope", "global")),
        forms=("@fuse(pattern_name)", "@fuse(ops=[op1, op2, ...])", "@fuse(scope=global)")),
    Spec("nofuse", "§7.5.2", "prevents fusing an operation with its neighbours", OPERATION, (
        opt("reason", STRING, "why fusion is disabled"),
    ), forms=("@nofuse", "@nofuse(reason=string)")),
    Spec("kernel", "§7.5.3", "selects an explicit kernel implementation", OPERATION, (
        req("name", KERNEL, "kernel name (modulec.ops.kernel_names)"),
        opt("autotune", BOOL, "use cuBLASLt autotuning", "true"),
        opt("workspace", INT, "workspace size override"),
        opt("fallback", BOOL, "allow fallback if the kernel is unavailable", "true"),
    ), forms=("@kernel(name)", "@kernel(name, params...)")),
    # §7.6 sharding ----------------------------------------------------------------
    Spec("shard", "§7.6.1", "partitions a tensor across devices", TENSOR | PARAM | INPUT, (
        req("strategy", enum("column", "row", "vocab", "replicated", "expert", "sequence", "batch",
                             "head"), "sharding strategy"),
        opt("tp_size", INT, "tensor parallel size"),
        opt("ep_size", INT, "expert parallel size"),
        opt("pp_size", INT, "pipeline parallel size"),
        opt("async_comm", BOOL, "overlap communication with compute", "true"),
        opt("reduce_scatter", BOOL, "use reduce-scatter instead of all-reduce", "true"),
        opt("parts", SIZES, "a fused parameter's parts along the sharded dim, in units "
            "(heads, columns), each split evenly across the ranks (`[num_heads, "
            "num_kv_heads, num_kv_heads]`)"),
    ), forms=("@shard(strategy)", "@shard(strategy, params...)")),
    Spec("partition", "§7.6.2", "assigns operations to a pipeline stage", OPERATION | BLOCK, (
        req("stage", INT, "pipeline stage index (0-based)"),
        opt("micro_batch", BOOL, "enable micro-batching", "true"),
        opt("recompute", BOOL, "recompute activations within the stage", "false"),
    ), forms=("@partition(stage)", "@partition(stage, params...)")),
    Spec("comm", "§7.6.3", "specifies a communication operation", TENSOR, (
        req("op", enum("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send",
                       "recv", "broadcast"), "communication operation"),
        opt("group", STRING, "communication group", '"default"'),
        opt("async", BOOL, "async communication", "true"),
        opt("bucket_size", INT, "gradient bucketing size"),
    ), forms=("@comm(op)", "@comm(op, params...)")),
    # §7.7 debugging ---------------------------------------------------------------
    Spec("assert", "§7.7.1", "inserts a runtime assertion", TENSOR | INPUT, (
        req("condition", EXPR, "condition that must hold"),
        opt("message", STRING, "error message"),
        opt("enabled", BOOL, "whether the assertion is checked", "true"),
    ), forms=("@assert(condition)", "@assert(condition, message=string)")),
    Spec("profile", "§7.7.2", "profiles an operation or block", OPERATION | BLOCK, (
        req("name", STRING, "profile region name"),
        opt("memory", BOOL, "track memory allocations", "false"),
        opt("cuda_events", BOOL, "use CUDA events for timing", "true"),
        opt("nvtx", BOOL, "emit NVTX markers", "true"),
    ), forms=("@profile(name)", "@profile(name, params...)")),
    Spec("trace", "§7.7.3", "traces execution", OPERATION | BLOCK, (
        opt("level", enum("ops", "tensors", "values"), "trace detail", "ops"),
    ), forms=("@trace", "@trace(level=detail_level)")),
    # §7.8 training ----------------------------------------------------------------
    Spec("frozen", "§7.8.1", "marks a parameter as frozen", PARAM, forms=("@frozen",)),
    Spec("trainable", "§7.8.2", "marks a parameter as trainable", PARAM, (
        opt("lr_scale", FLOAT, "learning-rate multiplier", "1.0"),
        opt("wd_scale", FLOAT, "weight-decay multiplier", "1.0"),
        opt("grad_clip", FLOAT, "per-parameter gradient clipping"),
    ), forms=("@trainable", "@trainable(params...)")),
    Spec("gradient", "§7.8.3", "controls gradient computation", TENSOR | PARAM | INPUT, (
        pos("mode", enum("compute", "skip", "accumulate", "checkpoint"), "gradient mode",
            "compute"),
        opt("scale", FLOAT, "gradient scaling factor", "1.0"),
        opt("clip", FLOAT, "gradient clipping threshold"),
    ), forms=("@gradient(mode)", "@gradient(mode, params...)")),
    # §5.11 graph semantics --------------------------------------------------------
    Spec("alias", "§5.11.2", "marks a destination as an alias of its source",
         frozenset({"output"}), forms=("x -> y @alias",)),
    Spec("noalias", "§5.11.2", "marks a destination as an independent copy",
         frozenset({"output"}), forms=("x -> copy() -> y @noalias",)),
    Spec("barrier", "§5.11.5", "orders the flow before the ones that follow", TENSOR,
         forms=("a -> op() -> b @barrier",)),
)

# Each annotation with its status; a KeyError here is an annotation without an entry in
# annotation_status.STATUS (every annotation must say whether it acts).
ANNOTATIONS: dict[str, Spec] = {spec.name: replace(spec, status=STATUS[spec.name])
                                for spec in _SPECS}


def usage(spec: Spec) -> str:
    """`@memory(mode, priority=0, prefetch=true, async=true)`."""
    if not spec.params:
        return "@" + spec.name
    parts = [p.name if p.positional and p.required else f"{p.name}={_default_text(p)}"
             for p in spec.params]
    return f"@{spec.name}({', '.join(parts)})"


def _default_text(param: Param) -> str:
    if param.default is REQUIRED:
        return "..."
    return "None" if param.default is None else str(param.default)


def key_text(key: "A.Name | A.String") -> str:
    return key.id if isinstance(key, A.Name) else key.value


def argument_values(note: A.Annotation) -> dict[str, A.Expr]:
    """The values an annotation's arguments bind to its parameters (first binding wins);
    validity is `check_annotations`'s business."""
    spec = ANNOTATIONS.get(note.name)
    if spec is None:
        return {}
    values: dict[str, A.Expr] = {}
    slots = iter(spec.positional)
    for arg in note.args or ():
        param = next(slots, None) if arg.key is None else spec.param(key_text(arg.key))
        if param is not None:
            values.setdefault(param.name, arg.value)
    return values


# ====================================================================== pipeline rule
@dataclass(frozen=True)
class StageRule:
    """E025 (§7.6.0): a checkpoint region must lie within one pipeline stage.

    `region` annotations mark checkpoint regions (switched off by `switch=off`), `stage`
    annotations assign pipeline stages (`stage_param`, an integer literal).
    """

    region: str = "checkpoint"
    switch: str = "granularity"
    off: str = "none"
    stage: str = "partition"
    stage_param: str = "stage"
    code: str = "E025"


PIPELINE = StageRule()
