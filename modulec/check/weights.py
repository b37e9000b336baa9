"""Weight mapping (spec §8, §4.5): a model's `hf_config:`, `hf_mapping:` and `hf_export:`
against its parameter tree.

    check_weights(instance)     # E010 (and E016/E002 for `if` guards) into instance.world
    weight_paths(instance)      # every tensor parameter: path, type, tied_to, optional, ...
    hf_plan(instance)           # the mapping as plain data (the weight schema of a build)

Parameter paths go through the submodule tree: `embedding`, `final_norm.weight`,
`blocks[{i}].attention.qkv_weight`. A `[n] x Block(...)` stack adds one index level; the
canonical placeholders are `{i}`, `{j}`, `{k}`, ... by depth, and a mapping key may name its
own (`blocks[{layer}]...`): keys are matched level by level, not by placeholder name.
Mapping values: a checkpoint name (`"model.layers.{i}.mlp.down_proj.weight"`),
`fuse(a, b, ..., dim=d)`, `transform(name, fn: f)`, `tied_to(path)` and
`stack_experts(source, dim=d)`. What is checked and why: docs/decisions.md,
"Weight mapping (issue 3)".
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field

from modulec.check.instance import Broken, Instance, Stack, Submodule, TensorParamValue, guard
from modulec.check.weight_index import (canonical_string, check_string, free_names,
                                        integer_constants)
from modulec.check.weight_messages import (describe_plan, head_span, listed, show_value,
                                           value_head, values_note)
from modulec.check.weight_paths import (PLACEHOLDER, WeightPath, dim_value, join_path,
                                        level_name, levels_in, path_segments, shape_of,
                                        stacks_of, strip_optional, weight_paths)
from modulec.check.world import did_you_mean
from modulec.diagnostics import Label
from modulec.semantic.consteval import NotConst, Undefined, evaluate
from modulec.syntax import ast as A
from modulec.syntax.printer import expr as show
from modulec.types.dims import Dim

EXPERT = "e"  # canonical name of stack_experts' placeholder in `hf_plan`
MAPPERS = ("fuse", "transform", "tied_to", "stack_experts")
CONFIG_FIELDS = ("architecture", "config_class", "model_type")


@dataclass(frozen=True)
class Transform:
    """An element- or layout-wise function applied on load (forward: checkpoint -> modulec
    tensor) and its inverse (applied on export)."""

    forward: str
    inverse: str
    min_rank: int = 0


TRANSFORMS: dict[str, Transform] = {
    "identity": Transform("x", "identity"),
    "neg": Transform("-x", "neg"),
    "exp": Transform("exp(x)", "log"),
    "log": Transform("log(x)", "exp"),
    "negate_exp": Transform("-exp(x)  (Mamba: A = -exp(A_log))", "log(-x)"),
    "transpose": Transform("swap the last two dims (Conv1D [in, out] -> [out, in])",
                           "transpose", min_rank=2),
}


# ====================================================================== entry points
def check_weights(instance: Instance) -> None:
    """Check the model's hf_config, hf_mapping and hf_export (E010) against its parameters."""
    _Analysis(instance).run()


def hf_plan(instance: Instance) -> list[dict]:
    """The hf_mapping of this instance as plain data, one dict per tensor parameter that is
    mapped or tied (diagnostics are not reported; run check_weights for those):

        {"param": "blocks[{i}].attention.qkv_weight", "shape": [12288, 4096],
         "stacks": [{"placeholder": "i", "count": 32}], "kind": "fuse",
         "hf": ["model.layers.{i}.self_attn.q_proj.weight", ...], "dim": 0, "fn": None,
         "optional": False}

    kind: "direct" (hf: one name), "fuse" (hf: the parts, concatenated along dim),
    "transform" (hf: one name; fn and its "inverse"), "tied" ("target": a parameter path;
    hf: []), "stack" (hf: the source names with the expert placeholder `{e}`; dim: the new
    dim; "inner": the source's own plan, kind direct or fuse). Placeholders in hf names are
    the canonical ones of `param`. "condition": the text of an `if` guard that could not be
    decided, when the entry sits under one.
    """
    world = instance.world
    world.quiet += 1
    try:
        analysis = _Analysis(instance)
        analysis.run()
    finally:
        world.quiet -= 1
    return analysis.plan


# ====================================================================== analysis
@dataclass
class _Target:
    """A mapping key resolved to a tensor parameter."""

    weight: WeightPath
    bound: dict[str, str]  # the key's placeholder names -> canonical level names
    node: A.Expr


@dataclass
class _Mapped:
    entry: A.Entry
    key: A.Expr
    target: _Target
    plan: dict | None
    branch: tuple
    optional: bool


@dataclass
class _Analysis:
    instance: Instance
    plan: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.world = self.instance.world
        self.paths = weight_paths(self.instance)
        self.by_path = {w.path: w for w in self.paths}
        self.sections = self.instance.definition.sections
        self.model = self.instance.name
        self.shown_levels: dict[str, str] = {}  # canonical level -> first name a key used
        self.meant: set[str] = set()  # paths an unresolved key probably meant

    def run(self) -> None:
        self.config()
        self.mapping()
        self.export()

    def error(self, message: str, span, label: str = "", **more) -> None:
        self.world.error("E010", message, span, label, **more)

    # ------------------------------------------------------------ hf_config
    def config(self) -> None:
        section = self.sections.get("hf_config")
        if section is None:
            return
        if not isinstance(section, A.Section):
            self.error("`hf_config` must be a section of entries", section.key.span,
                       help=['write `architecture: "...ForCausalLM"` and a `param_mapping:` '
                             'section on the lines below'])
            return
        params = [p.name for p in self.instance.definition.decl.params or ()]
        seen: dict[str, A.Expr] = {}
        for item, _ in self.flatten(section.body):
            if isinstance(item, A.Section) and item.name == "param_mapping":
                for inner, _ in self.flatten(item.body):
                    self.config_param(inner, params, seen, top=False)
            elif isinstance(item, A.Section):
                self.error(f"unknown `hf_config` section `{show(item.key)}`", item.key.span,
                           help=did_you_mean(show(item.key), ["param_mapping"]) or
                           ["`hf_config` holds `architecture`, `config_class` and a "
                            "`param_mapping:` section"])
            elif isinstance(item, A.Entry) and isinstance(item.key, A.Name) and \
                    item.key.id in CONFIG_FIELDS:
                if not isinstance(item.value, A.String):
                    self.error(f"`{item.key.id}` must be a string", item.value.span,
                               f"this is `{show_value(item.value)}`",
                               help=[f'write `{item.key.id}: "{show_value(item.value)}"`'])
            else:
                self.config_param(item, params, seen, top=True)

    def config_param(self, item, params: list[str], seen: dict, top: bool) -> None:
        """`dsl_param: hf_field` (in `param_mapping:`, or at the top of `hf_config:`)."""
        if not isinstance(item, A.Entry) or not isinstance(item.key, A.Name):
            self.error("expected `parameter: hf_config_field`", head_span(item),
                       help=["`param_mapping:` maps each model parameter to the field of the "
                             "HF config that sets it: `d_model: hidden_size`"])
            return
        name = item.key.id
        if top and isinstance(item.value, A.String):
            self.error(f"unknown `hf_config` entry `{name}`", item.key.span,
                       help=did_you_mean(name, CONFIG_FIELDS) or
                       [f"known entries: {', '.join(f'`{c}`' for c in CONFIG_FIELDS)}"])
            return
        if name not in params:
            extra = list(CONFIG_FIELDS) + ["param_mapping"] if top else []
            self.error(f"`{name}` is not a parameter of `{self.model}`", item.key.span,
                       "not in the model's parameter list",
                       help=did_you_mean(name, params + extra) or
                       [f"`{self.model}` takes {listed(params)}"])
        elif name in seen:
            self.error(f"`{name}` is mapped twice in `hf_config`", item.key.span,
                       secondary=[Label(seen[name].span, "first mapped here")])
        else:
            seen[name] = item.key
        if not isinstance(item.value, (A.Name, A.String)):
            self.error("an HF config field is a name", item.value.span,
                       f"this is `{show_value(item.value)}`",
                       help=["write the field of config.json: `d_model: hidden_size`"])

    # ------------------------------------------------------------ hf_mapping
    def mapping(self) -> None:
        section = self.sections.get("hf_mapping")
        if section is None:
            self.tied_plan(set())
            return
        if not isinstance(section, A.Section):
            self.error("`hf_mapping` must be a section of entries", section.key.span,
                       help=['write one `parameter: "checkpoint.name"` entry per line below'])
            return
        mapped: dict[str, list[_Mapped]] = {}
        for item, branch in self.flatten(section.body):
            if not isinstance(item, A.Entry):
                self.error("expected a weight mapping `parameter: \"checkpoint.name\"`",
                           head_span(item), help=self._entry_help())
                continue
            key, optional = strip_optional(item.key)
            target = self.resolve(key, optional)
            if target is None:
                continue
            plan = self.value(item.value, target)
            mapping = _Mapped(item, key, target, plan, branch, optional)
            earlier = [m for m in mapped.get(target.weight.path, [])
                       if not _exclusive(m.branch, branch)]
            if earlier:
                self.error(f"`{show(key)}` is mapped twice", key.span,
                           "second mapping of this parameter",
                           secondary=[Label(earlier[0].key.span, "first mapped here")],
                           help=["each weight loads from one place; remove one of the entries"])
            mapped.setdefault(target.weight.path, []).append(mapping)
            if plan is not None:
                self.plan.append(self.plan_entry(target, plan, optional, branch))
        self.tied_checks(mapped)
        self.coverage(section, mapped)
        self.tied_plan(set(mapped))

    def _entry_help(self) -> list[str]:
        return ['map a parameter to a checkpoint tensor: `final_norm.weight: "model.norm.weight"`, '
                "or to `fuse(...)`, `transform(...)`, `tied_to(...)` or `stack_experts(...)`"]

    def coverage(self, section: A.Section, mapped: dict) -> None:
        for weight in self.paths:
            if weight.tied_to or weight.optional or weight.path in mapped or \
                    weight.path in self.meant:
                continue
            shown = self.show_path(weight.path)
            notes = []
            if weight.span is not None and weight.span.file != section.span.file:
                notes.append(f"`{shown}` is declared at {weight.span.file}:{weight.span.line}")
            self.error(f"parameter `{shown}` has no `hf_mapping` entry", section.key.span,
                       "each weight that is not tied loads from the checkpoint",
                       help=[f'add `{shown}: "<checkpoint tensor name>"` (shape {weight.type})'],
                       notes=notes)

    def tied_checks(self, mapped: dict) -> None:
        """A declared `tied_to` parameter may be mapped only as tied to its target, or to
        exactly the checkpoint tensor(s) its target loads."""
        for path, entries in mapped.items():
            weight = self.by_path[path]
            if weight.tied_to is None:
                continue
            target = self.show_path(weight.tied_to)
            for mapping in entries:
                plan = mapping.plan
                if plan is None:
                    continue
                if plan["kind"] == "tied":
                    if plan["target"] != weight.tied_to:
                        arg = mapping.entry.value.args[0].value
                        self.error(f"`{show(mapping.key)}` is declared `tied_to({target})`",
                                   arg.span, f"this ties it to `{self.show_path(plan['target'])}`",
                                   help=[f"write `tied_to({target})`, or leave the entry out: a "
                                         "tied weight needs no mapping"])
                    continue
                sources = [m.plan for m in mapped.get(weight.tied_to, []) if m.plan]
                if any(_same_source(plan, s) for s in sources):
                    continue
                label = (f"`{target}` loads {describe_plan(sources[0])}" if sources
                         else f"it shares the storage of `{target}`")
                self.error(f"`{show(mapping.key)}` is tied to `{target}` and cannot load a "
                           "checkpoint tensor of its own", value_head(mapping.entry.value),
                           label, help=[f"map it with `tied_to({target})`, or leave the entry "
                                        "out: a tied weight needs no mapping"])

    def tied_plan(self, mapped: set) -> None:
        for weight in self.paths:
            if weight.tied_to and weight.path not in mapped:
                self.plan.append({
                    "param": weight.path, "shape": shape_of(weight.type),
                    "stacks": stacks_of(weight), "kind": "tied", "target": weight.tied_to,
                    "hf": [], "dim": None, "fn": None, "optional": weight.optional,
                })

    def plan_entry(self, target: _Target, plan: dict, optional: bool, branch: tuple) -> dict:
        entry = {"param": target.weight.path, "shape": shape_of(target.weight.type),
                 "stacks": stacks_of(target.weight), "optional": optional}
        entry.update(plan)
        entry.setdefault("dim", None)
        entry.setdefault("fn", None)
        conditions = [text for _, _, text in branch]
        if conditions:
            entry["condition"] = " and ".join(conditions)
        return entry

    # ------------------------------------------------------------ mapping values
    def value(self, node, target: _Target) -> dict | None:
        if isinstance(node, A.String):
            if not self.strings([node], target):
                return None
            return {"kind": "direct", "hf": [self.canonical(node.value, target)]}
        if isinstance(node, A.Call) and isinstance(node.func, A.Name):
            handler = {"fuse": self.fuse, "transform": self.transform, "tied_to": self.tied_to,
                       "stack_experts": self.stack_experts}.get(node.func.id)
            if handler is not None:
                return handler(node, target)
            self.error(f"unknown weight mapping `{node.func.id}`", node.func.span,
                       "not one of fuse, transform, tied_to, stack_experts",
                       help=did_you_mean(node.func.id, MAPPERS) or self._entry_help())
            return None
        self.error("a weight mapping must be a checkpoint name or a mapping call",
                   value_head(node), f"this is `{show_value(node)}`", help=self._entry_help())
        return None

    def fuse(self, call: A.Call, target: _Target, rank: int | None = None,
             extra: frozenset = frozenset(), where: str = "") -> dict | None:
        """`fuse("a", "b", ..., dim=d)`: the parts concatenated along `dim` (torch.cat)."""
        rank = len(target.weight.type.dims) if rank is None else rank
        parts, keywords = _split_args(call)
        dim_arg = self.keywords(call, keywords, ("dim",), '`fuse("a", "b", ..., dim=0)`')
        ok = True
        if len(parts) < 2:
            self.error("`fuse` needs at least two checkpoint tensors", call.func.span,
                       f"{len(parts)} given",
                       help=["map a single tensor with its name alone: "
                             '`param: "checkpoint.name"`'])
            ok = False
        strings = []
        for part in parts:
            if isinstance(part.value, A.String):
                strings.append(part.value)
            else:
                self.error("a `fuse` part must be a checkpoint name (a string)",
                           value_head(part.value), f"this is `{show_value(part.value)}`")
                ok = False
        ok = self.strings(strings, target, extra) and ok
        dim = self.dim(call, dim_arg.get("dim"), rank, target, "fuse", where, required=True)
        if not ok or dim is None:
            return None
        return {"kind": "fuse", "hf": [self.canonical(s.value, target, extra) for s in strings],
                "dim": dim}

    def transform(self, call: A.Call, target: _Target) -> dict | None:
        """`transform("name", fn: f)`: f applied to the checkpoint tensor on load."""
        parts, keywords = _split_args(call)
        given = self.keywords(call, keywords, ("fn",), '`transform("checkpoint.name", fn: f)`')
        ok = True
        if len(parts) != 1:
            span = parts[1].value.span if len(parts) > 1 else call.func.span
            self.error("`transform` takes one checkpoint name", span,
                       f"{len(parts)} given",
                       help=["to transform several tensors, map each parameter on its own"])
            ok = False
        elif not isinstance(parts[0].value, A.String):
            self.error("`transform` applies to a checkpoint name (a string)",
                       value_head(parts[0].value), f"this is `{show_value(parts[0].value)}`")
            ok = False
        else:
            ok = self.strings([parts[0].value], target) and ok
        fn = given.get("fn")
        if fn is None:
            self.error("`transform` needs `fn:`", call.func.span, "no function given",
                       help=[f"known transforms: {listed(TRANSFORMS)}"])
            return None
        name = fn.id if isinstance(fn, A.Name) else fn.value if isinstance(fn, A.String) else None
        if name not in TRANSFORMS:
            shown = name if name is not None else show_value(fn)
            self.error(f"unknown transform `{shown}`", fn.span, "not a known transform",
                       help=did_you_mean(shown, TRANSFORMS) +
                       [f"known transforms: {listed(TRANSFORMS)}"])
            return None
        rank = len(target.weight.type.dims)
        if rank < TRANSFORMS[name].min_rank:
            self.error(f"`{name}` needs a tensor of rank {TRANSFORMS[name].min_rank} or more",
                       fn.span, f"`{self.show_key(target)}` has shape {target.weight.type}")
            return None
        if not ok:
            return None
        return {"kind": "transform", "hf": [self.canonical(parts[0].value.value, target)],
                "fn": name, "inverse": TRANSFORMS[name].inverse}

    def tied_to(self, call: A.Call, target: _Target) -> dict | None:
        """`tied_to(path)`: the parameter shares the storage of another parameter."""
        parts, keywords = _split_args(call)
        self.keywords(call, keywords, (), "`tied_to(embedding)`")
        if len(parts) != 1:
            span = parts[1].value.span if len(parts) > 1 else call.func.span
            self.error("`tied_to` names one parameter", span, f"{len(parts)} given")
            return None
        node = parts[0].value
        other = self.resolve(node, False, key=False)
        if other is None:
            return None
        unbound = [name for name in other.bound if name not in target.bound]
        if unbound:
            self.error(f"`{{{unbound[0]}}}` is not a placeholder of the key", node.span,
                       "the key does not bind it", help=self._placeholder_help(target))
            return None
        if other.weight.path == target.weight.path:
            self.error(f"`{show(node)}` cannot be tied to itself", node.span)
            return None
        mine, theirs = target.weight.type, other.weight.type
        if mine.dims != theirs.dims:
            self.error(f"`{show(node)}` has shape {theirs}, `{self.show_key(target)}` has "
                       f"shape {mine}", node.span, "tied weights must have the same shape")
            return None
        return {"kind": "tied", "target": other.weight.path, "hf": []}

    def stack_experts(self, call: A.Call, target: _Target) -> dict | None:
        """`stack_experts(source, dim=d)`: `source` (a string or a `fuse(...)`) evaluated for
        each expert e = 0 .. n-1 (its placeholder `{e}`), stacked along the new dim `d`;
        n is the parameter's size along `d`."""
        parts, keywords = _split_args(call)
        given = self.keywords(call, keywords, ("dim", "num_experts"),
                              '`stack_experts("...experts.{e}.w2.weight", dim=0)`')
        shape = target.weight.type
        rank = len(shape.dims)
        if len(parts) != 1:
            span = parts[1].value.span if len(parts) > 1 else call.func.span
            self.error("`stack_experts` takes one source: a checkpoint name or a `fuse(...)`",
                       span, f"{len(parts)} given")
            return None
        source = parts[0].value
        strings = _source_strings(source)
        if strings is None:
            self.error("the source of `stack_experts` must be a checkpoint name or a `fuse(...)`",
                       value_head(source), f"this is `{show_value(source)}`")
            return None
        if rank < 2:
            self.error("`stack_experts` needs a parameter with an expert dimension",
                       call.func.span, f"`{self.show_key(target)}` has shape {shape}",
                       help=["the experts are stacked along a dimension of their own: "
                             "`[num_experts, out, in]`"])
            return None
        dim = self.dim(call, given.get("dim"), rank, target, "stack_experts", "", required=False)
        if dim is None:
            return None
        used = set()
        for string in strings:
            used |= free_names(string.value, integer_constants(self.instance))
        experts = sorted(used - set(target.bound))
        if not experts:
            self.error("`stack_experts` needs an expert placeholder such as `{e}`",
                       call.func.span, "no checkpoint name of its source has one",
                       help=['write the expert index into each name: '
                             '`"model.layers.{i}.mlp.experts.{e}.down_proj.weight"`'])
            return None
        if len(experts) > 1:
            self.error(f"`stack_experts` takes one expert placeholder, found "
                       f"{listed([f'{{{e}}}' for e in experts])}", call.func.span,
                       help=self._placeholder_help(target) +
                       ["the one placeholder that the key does not bind is the expert index"])
            return None
        expert = experts[0]
        count = given.get("num_experts")
        if count is not None:
            self.num_experts(count, shape.dims[dim], target, dim)
        if isinstance(source, A.String):
            if not self.strings([source], target, frozenset({expert})):
                return None
            inner = {"kind": "direct",
                     "hf": [self.canonical(source.value, target, frozenset({expert}))]}
        else:
            inner = self.fuse(source, target, rank - 1, frozenset({expert}),
                              where=" of one expert")
            if inner is None:
                return None
        return {"kind": "stack", "hf": inner["hf"], "dim": dim, "expert": EXPERT,
                "count": dim_value(shape.dims[dim]), "inner": inner}

    def num_experts(self, node, size: Dim, target: _Target, dim: int) -> None:
        try:
            value = evaluate(node, self.instance.env())
        except (NotConst, Undefined) as exc:
            self.error("`num_experts` must be a compile-time value", node.span,
                       getattr(exc, "reason", "not a parameter of the model"),
                       help=did_you_mean(getattr(getattr(exc, "node", None), "id", ""),
                                         self.instance.values))
            return
        if isinstance(value, Dim) and value.is_const and size.is_const and \
                value.value != size.value:
            self.error(f"`num_experts` is {value.value}, but `{self.show_key(target)}` has "
                       f"{size.value} experts along dim {dim}", node.span,
                       f"shape {target.weight.type}")

    def dim(self, call: A.Call, node, rank: int, target: _Target, fn: str, where: str,
            required: bool) -> int | None:
        if node is None:
            if required:
                self.error(f"`{fn}` needs `dim=`", call.func.span, "no dimension given",
                           help=["`dim=0` concatenates along the first dimension (the rows "
                                 "of an [out, in] weight)"])
                return None
            return 0
        value = node.value if isinstance(node, A.Number) else \
            -node.operand.value if isinstance(node, A.Unary) and node.op == "-" and \
            isinstance(node.operand, A.Number) else None
        if not isinstance(value, int):
            self.error("`dim` must be an integer", node.span,
                       f"this is `{show_value(node)}`")
            return None
        if not -rank <= value < rank:
            self.error(f"`dim={value}` is out of range for `{self.show_key(target)}`{where}",
                       node.span, f"rank {rank}: dim is 0 .. {rank - 1}" if rank else
                       "a scalar has no dimension",
                       notes=[f"`{self.show_key(target)}` has shape {target.weight.type}"])
            return None
        return value % rank

    def keywords(self, call: A.Call, keywords: list, allowed: tuple, form: str) -> dict:
        """Keyword arguments by name; unknown or repeated ones are E010."""
        found: dict = {}
        for arg in keywords:
            name = arg.key.id if isinstance(arg.key, A.Name) else arg.key.value \
                if isinstance(arg.key, A.String) else None
            if name in allowed and name not in found:
                found[name] = arg.value
                continue
            what = f"`{call.func.id}` has no argument `{name}`" if name not in allowed \
                else f"`{name}` is given twice"
            self.error(what, arg.key.span, help=did_you_mean(name or "", allowed) +
                       [f"write {form}"])
        return found

    # ------------------------------------------------------------ placeholders
    def strings(self, strings: list, target: _Target, extra: frozenset = frozenset()) -> bool:
        """Every `{...}` of a checkpoint name is a placeholder of the key (or `extra`, the
        expert index) or an index expression over them (`{i + n_dense}`), and every
        placeholder of the key appears in each name (modulec/check/weight_index.py)."""
        ok = True
        for string in strings:
            ok = check_string(self, string, target, extra) and ok
        return ok

    def _placeholder_help(self, target: _Target) -> list[str]:
        if target.bound:
            return [f"the key binds {listed([f'{{{n}}}' for n in target.bound])}"]
        return ["the key names a parameter outside any layer stack: it has no placeholder"]

    def canonical(self, text: str, target: _Target, extra: frozenset = frozenset()) -> str:
        rename = dict(target.bound)
        rename.update({name: EXPERT for name in extra})
        return canonical_string(text, rename, integer_constants(self.instance))

    # ------------------------------------------------------------ keys
    def resolve(self, node, optional: bool, key: bool = True) -> _Target | None:
        """The tensor parameter a path names, or None (reported, except an absent
        conditional parameter under an optional key). For a mapping key (`key`), a path
        that names no tensor marks the closest tensor path as meant (see `mark`)."""
        segments = path_segments(node)
        if segments is None:
            self.error("a mapping key must be a parameter path", value_head(node),
                       f"this is `{show_value(node)}`",
                       help=["write the path through the parameters: "
                             "`blocks[{i}].attention.qkv_weight`"])
            if key and isinstance(node, A.String):
                self.mark(node.value, [])
            return None
        user_levels = [s[1].name for s in segments
                       if s[0] == "index" and isinstance(s[1], A.Placeholder)]
        if key:
            for depth, name in enumerate(user_levels):
                self.shown_levels.setdefault(level_name(depth), name)
        outcome = self._walk_key(node, segments, optional, user_levels)
        if isinstance(outcome, _Target):
            return outcome
        if key and outcome is not None:
            self.mark(show(node), user_levels, outcome or None)
        return None

    def _walk_key(self, node, segments: list, optional: bool, user_levels: list):
        """A _Target; or, once reported, the paths the key may have meant (a list, empty
        for all paths), or None when nothing should be marked."""
        instance, value, prefix, bound, stack = self.instance, None, "", {}, None
        for kind, payload, _ in segments:
            if kind == "name":
                if stack is not None:
                    return self.not_indexed(node, prefix, stack, user_levels)
                if isinstance(value, TensorParamValue):
                    self.error(f"`{self.show_user(prefix, user_levels)}` is a tensor: it has no "
                               f"part `{payload}`", node.span,
                               help=self.suggest(show(node), user_levels))
                    return []
                if payload not in instance.params:
                    return self.missing(node, instance, payload, optional, user_levels)
                value = instance.params[payload]
                prefix = join_path(prefix, payload)
                if isinstance(value, Broken):
                    return None
                if isinstance(value, Submodule):
                    instance = value.instance
                elif isinstance(value, Stack):
                    stack = value
            else:
                if stack is None:
                    self.error(f"`{self.show_user(prefix, user_levels)}` is not a stack of layers",
                               payload.span, "an index needs a `[n] x Block(...)` parameter",
                               help=self.suggest(show(node), user_levels))
                    return []
                if not isinstance(payload, A.Placeholder):
                    self.error("a stack is indexed with a placeholder such as `{i}`",
                               payload.span, "one entry maps the weight of every layer",
                               help=[f"write `{self.show_user(prefix, user_levels)}[{{i}}]`"])
                    return []
                if payload.name in bound:
                    self.error(f"placeholder `{{{payload.name}}}` is used twice in this key",
                               payload.span, "each stack level needs a placeholder of its own")
                    return []
                bound[payload.name] = level_name(len(bound))
                prefix += f"[{{{bound[payload.name]}}}]"
                instance, value, stack = stack.instance, None, None
        if stack is not None:
            return self.not_indexed(node, prefix, stack, user_levels)
        if not isinstance(value, TensorParamValue):
            inner = [w.path for w in self.paths if w.path.startswith(prefix + ".")]
            what = "a layer" if value is None else "a module"
            shown = [self.show_user(p, user_levels) for p in inner]
            self.error(f"`{show(node)}` is {what}, not a tensor", node.span,
                       f"`{_module_name(value, instance)}` holds "
                       f"{len(inner)} tensor{'s' if len(inner) != 1 else ''}",
                       help=[f"did you mean {listed(shown[:4], 'or')}?"] if shown else [])
            return inner
        return _Target(self.by_path[prefix], bound, node)

    def not_indexed(self, node, prefix: str, stack: Stack, user_levels: list) -> list:
        depth = len(levels_in(prefix))
        level = user_levels[depth] if len(user_levels) > depth else level_name(depth)
        shown = self.show_user(prefix, user_levels)
        self.error(f"`{shown}` is a stack of {stack.count} layers: index it with a placeholder",
                   node.span, "one entry maps the weight of every layer",
                   help=[f"write `{shown}[{{{level}}}]...`"] +
                   self.suggest(show(node), user_levels))
        return []

    def missing(self, node, owner: Instance, name: str, optional: bool,
                user_levels: list) -> list | None:
        declared = next((p for p in owner.definition.params if p.name == name), None)
        path = show(node)
        if declared is not None and declared.condition is not None:
            if optional:
                return None
            condition = show(declared.condition)
            self.error(f"`{path}` is absent from this `{self.model}`: its guard "
                       f"`{condition}` is false", node.span,
                       f"`{owner.name}` declares `{name}` only `if {condition}`",
                       help=[f"mark the key optional (`{path}?: ...`) or put the entry under "
                             f"`if ...:`"],
                       notes=[values_note(owner, declared.condition)])
            return None
        where = f"`{owner.name}` has no parameter `{name}`"
        self.error(f"unknown parameter `{path}`", node.span, where,
                   help=self.suggest(path, user_levels))
        return []

    def mark(self, path: str, user_levels: list, among: list | None = None) -> None:
        """A key that names no tensor most likely meant the closest path: that path's
        missing mapping is not reported on top (one typo, one error)."""
        shown = {self.show_user(p, user_levels): p for p in among or [w.path for w in self.paths]}
        close = difflib.get_close_matches(path, list(shown), n=1, cutoff=0.6)
        if close:
            self.meant.add(shown[close[0]])

    def suggest(self, path: str, user_levels: list) -> list[str]:
        return did_you_mean(path, [self.show_user(w.path, user_levels) for w in self.paths])

    def show_user(self, path: str, user_levels: list) -> str:
        """A canonical path with the placeholders a key used at each level."""
        rename = {level_name(d): name for d, name in enumerate(user_levels)}
        return PLACEHOLDER.sub(lambda m: "{" + rename.get(m[1], m[1]) + "}", path)

    def show_path(self, path: str) -> str:
        """A canonical path with the placeholder names the mapping's keys used."""
        return PLACEHOLDER.sub(lambda m: "{" + self.shown_levels.get(m[1], m[1]) + "}", path)

    def show_key(self, target: _Target) -> str:
        return show(target.node)

    # ------------------------------------------------------------ hf_export
    def export(self) -> None:
        section = self.sections.get("hf_export")
        if section is None:
            return
        if not isinstance(section, A.Section):
            self.error("`hf_export` must be a section of entries", section.key.span)
            return
        for item, _ in self.flatten(section.body):
            if isinstance(item, A.Entry):
                key, value = item.key, [item.value]
            elif isinstance(item, A.Flow) and len(item.steps) >= 2:
                key, value = item.source.expr, [s.expr for s in item.steps[1:]]
            else:
                self.error("expected an export mapping `parameter: \"checkpoint.name\"` or "
                           "`parameter -> split(...)`", head_span(item))
                continue
            key, optional = strip_optional(key)
            target = self.resolve(key, optional, key=False)
            if target is None:
                continue
            for string in _all_strings(value):
                for name in free_names(string.value, integer_constants(self.instance)):
                    if name not in target.bound:
                        self.error(f"`{{{name}}}` is not a placeholder of the key", string.span,
                                   "the key does not bind it",
                                   help=self._placeholder_help(target))
                        break

    # ------------------------------------------------------------ `if` inside sections
    def flatten(self, body, branch: tuple = ()) -> list[tuple]:
        """The items of a section with `if` blocks decided by the instance's values; an
        undecided `if` contributes both branches, tagged so they never count as duplicates."""
        items = []
        for item in body:
            if isinstance(item, A.IfBlock):
                verdict = self.guard(item.test)
                if verdict is True or verdict is False:
                    items += self.flatten(item.body if verdict else (item.orelse or ()), branch)
                else:
                    text = show(item.test)
                    items += self.flatten(item.body, branch + ((id(item), True, text),))
                    items += self.flatten(item.orelse or (),
                                          branch + ((id(item), False, f"not ({text})"),))
            elif not isinstance(item, A.Docstring):
                items.append((item, branch))
        return items

    def guard(self, test):
        return guard(self.instance, test, "a mapping entry is selected at compile time; "
                     "branch on the model's parameters")


# ====================================================================== helpers
def _exclusive(a: tuple, b: tuple) -> bool:
    """Whether two entries sit in different branches of one undecided `if`."""
    taken = {ident: side for ident, side, _ in a}
    return any(ident in taken and taken[ident] != side for ident, side, _ in b)


def _split_args(call: A.Call) -> tuple[list, list]:
    return [a for a in call.args if a.key is None], [a for a in call.args if a.key is not None]


def _source_strings(source) -> list | None:
    if isinstance(source, A.String):
        return [source]
    if isinstance(source, A.Call) and isinstance(source.func, A.Name) and \
            source.func.id == "fuse":
        return [a.value for a in source.args if a.key is None and isinstance(a.value, A.String)]
    return None


def _all_strings(nodes) -> list:
    found = []
    for node in nodes:
        if isinstance(node, A.String):
            found.append(node)
        elif isinstance(node, A.Call):
            for arg in node.args:
                found += _all_strings([arg.key, arg.value])
        elif isinstance(node, (A.ListExpr,)):
            found += _all_strings(node.items)
    return found


def _same_source(a: dict, b: dict) -> bool:
    keys = ("kind", "hf", "dim", "fn")
    return all(a.get(k) == b.get(k) for k in keys)


def _module_name(value, instance: Instance) -> str:
    if isinstance(value, Submodule):
        return value.instance.name
    return instance.name


