"""A compiled program for the runtime: the Graph IR, weight schema and metadata of one model
at concrete sizes, from a `.module` file (compiled on the fly) or an IR document written by
`modulec build -o`.

Kernels need every dim sized (a `view` carries its target shape), so a program is built for
the shapes of the inputs it runs on: `ModuleSource.program(inputs)` binds the symbolic dims
of the model's declared inputs (`token_ids: [B, T, int32]`) to the given tensors' sizes and
builds once per distinct binding.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from modulec.ir.graph import Graph
from modulec.ir.serialize import IR_VERSION, graph_from_data
from runtime.errors import RuntimeUserError


@dataclass(frozen=True)
class Program:
    graph: Graph
    document: dict

    @property
    def weight_schema(self) -> list:
        return self.document.get("weight_schema", [])

    @property
    def metadata(self) -> dict:
        return self.document["metadata"]

    def input_names(self) -> list[str]:
        return [i["name"] for i in self.metadata["inputs"]]

    def output_names(self) -> list[str]:
        entry = self.graph.function(self.graph.entry)
        return [(entry.value(o).name if entry.value(o) else "") or o for o in entry.outputs]


def program_from_document(document: dict) -> Program:
    """A program from a `modulec build -o` document (already parsed JSON), verified first."""
    from modulec.ir.load import check_document

    problems = check_document(document)
    if problems:  # refused before a tensor is made: the verifier's report is the error
        raise RuntimeUserError(f"invalid IR: {problems[0]}", help=problems[1:8] +
                               ["`modulec ir verify FILE` lists every problem"])
    if document.get("ir_version") != IR_VERSION:
        raise RuntimeUserError(f"IR version {document.get('ir_version')!r} is not "
                               f"{IR_VERSION}", help=["rebuild it with this modulec"])
    try:
        return Program(graph_from_data(document["graph"]), document)
    except (KeyError, TypeError, ValueError) as exc:
        raise RuntimeUserError(f"malformed IR document ({exc})",
                               help=["`modulec ir verify FILE` says what is wrong"]) from None


def load_ir(path: Path) -> Program:
    from modulec.ir.load import read_document

    document, problems = read_document(path)
    if problems:
        raise RuntimeUserError(f"cannot read IR: {problems[0]}")
    return program_from_document(document)


@dataclass
class ModuleSource:
    """A `.module` model and how to size it; builds programs per input shapes."""

    path: Path
    settings: dict[str, str] = field(default_factory=dict)  # --set name=value
    config: Path | None = None  # a HuggingFace config.json
    model: str | None = None
    search_path: tuple[Path, ...] = ()
    derive_written: bool = False  # ignore backward sections written in the source
    planning: object = None  # modulec.lower.build_plan.PlanOptions (e.g. a memory budget)
    lora: object = None  # modulec.lower.lora.LoraOptions: LoRA on
    distributed: object = None  # modulec.plan.distributed.DataParallel: data parallel
    tensor_parallel: int = 1  # tensor parallel size: each rank's program (`--tp`)
    sequence_parallel: bool = False  # `--sp`: the sequence split between the TP regions
    # with --tp: the backward collectives overlapped with the weight gradients (False:
    # `--no-tp-overlap`, modulec.lower.tp_overlap)
    tp_overlap: bool = True
    # modulec.plan.pipeline.Pipeline: the `pipeline` section (--pp) of the programs built at
    # given sizes (the one with free dims, read for names and parameters, has none)
    pipeline: object = None
    precision: str | None = None  # "fp8": the std FP8 recipe on the model (--precision fp8)
    precision_overrides: dict | None = None  # its --fp8-* changes (fp8_recipe.std_recipe)
    _built: dict = field(default_factory=dict)
    _declared: list | None = None  # the inputs as declared (dims by name)

    def program(self, shapes: dict[str, int] | None = None, planned: bool = True) -> Program:
        """The program at these dim sizes; `planned=False` skips the memory planner (a
        budget needs every size; reading the declared inputs does not)."""
        key = (tuple(sorted((shapes or {}).items())), planned and self.planning is not None)
        if key not in self._built:
            self._built[key] = self._build(dict(key[0]), self.planning if key[1] else None)
        return self._built[key]

    def program_for(self, inputs: dict) -> Program:
        """The program for these input tensors (by declared input name)."""
        if self._declared is None:
            self._declared = self.program(planned=False).metadata["inputs"]
        return self.program(bind_dims(self._declared, inputs))

    def _build(self, shapes: dict[str, int], planning) -> Program:
        from modulec.lower.build import BuildRequest, build
        from modulec.lower.build_plan import PlanFailure

        request = BuildRequest(Path(self.path), tuple(self.search_path), self.model,
                               dict(self.settings), shapes, self.config,
                               derive_written=self.derive_written, planning=planning,
                               lora=self.lora, distributed=self.distributed,
                               tensor_parallel=self.tensor_parallel,
                               sequence_parallel=self.sequence_parallel,
                               tp_overlap=self.tp_overlap,
                               pipeline=self.pipeline if shapes else None,
                               precision=self.precision,
                               precision_overrides=self.precision_overrides)
        try:
            result = build(request)
        except PlanFailure as exc:
            raise RuntimeUserError(str(exc)) from None
        self._warn(result.notices)
        if getattr(result, "failure", None):  # the memory budget cannot be met
            raise RuntimeUserError(result.failure)
        errors = [d for d in result.diagnostics if d.is_error]
        if errors or result.document is None:
            raise RuntimeUserError(f"{self.path} does not build", help=[_render(result)])
        return Program(result.graph, result.document)


    def _warn(self, notices: list[str]) -> None:
        """The config fields the mapping names but the config lacks (they keep the
        model's defaults): a warning in every command that loads, once per model."""
        shown = self.__dict__.setdefault("_warned", set())
        for notice in notices:
            if notice not in shown:
                shown.add(notice)
                print(f"warning: {notice}", file=sys.stderr)


def bind_dims(declared: list[dict], inputs: dict) -> dict[str, int]:
    """Sizes of the symbolic dims of the declared inputs, read off the given tensors;
    a tensor of the wrong rank, or two sizes for one dim, is an error."""
    sizes: dict[str, int] = {}
    for spec in declared:
        name = spec["name"]
        if name not in inputs:
            raise RuntimeUserError(f"input `{name}` is missing",
                                   help=[f"the model's inputs: {_names(declared)}"])
        _bind_one(spec, tuple(inputs[name].shape), sizes)
    extra = set(inputs) - {s["name"] for s in declared}
    if extra:
        raise RuntimeUserError(f"unknown input(s) {', '.join(sorted(extra))}",
                               help=[f"the model's inputs: {_names(declared)}"])
    return sizes


def _bind_one(spec: dict, shape: tuple, sizes: dict) -> None:
    dims = spec["shape"]
    if len(dims) != len(shape) and not ("*" in dims and len(shape) >= len(dims) - 1):
        raise RuntimeUserError(f"input `{spec['name']}` has shape {list(shape)}, the model "
                               f"declares [{', '.join(dims)}]")
    if "*" in dims:  # `[*, d]`: any leading dims; the rest align from the end
        star = dims.index("*")
        dims = dims[:star] + dims[star + 1:]
        shape = shape[:star] + shape[len(shape) - len(dims) + star:]
    for dim, size in zip(dims, shape):
        if dim.isdigit():
            if int(dim) != size:
                raise RuntimeUserError(f"input `{spec['name']}`: dim of size {size} where "
                                       f"the model declares {dim}")
        elif dim.isidentifier():
            if sizes.setdefault(dim, size) != size:
                raise RuntimeUserError(f"input `{spec['name']}`: `{dim}` is {size} here "
                                       f"but {sizes[dim]} in another input")


def _names(declared: list[dict]) -> str:
    return ", ".join(f"{s['name']}: [{', '.join(s['shape'])}, {s['dtype']}]" for s in declared)


def _render(result) -> str:
    from modulec.diagnostics import render_human

    sources = {result.source.name: result.source} if result.source else {}
    return render_human([d for d in result.diagnostics if d.is_error], sources, color=False)


@dataclass
class IRSource:
    """A program read from an IR document (`modulec build -o`): built for fixed sizes, so
    inputs must have exactly the shapes it was built for."""

    path: Path
    settings: dict = field(default_factory=dict)
    _program: Program | None = None

    def program(self, shapes: dict | None = None, planned: bool = True) -> Program:
        if self._program is None:
            self._program = load_ir(self.path)
        return self._program

    @property
    def tensor_parallel(self) -> int:
        """The document's tensor-parallel size: its `tensor_parallel` section's (a rank
        program of `modulec build --tp M`), 1 without one."""
        return tp_size(self.program().document)

    @property
    def sequence_parallel(self) -> bool:
        return tp_sequence_parallel(self.program().document)

    def program_for(self, inputs: dict) -> Program:
        program = self.program()
        declared = program.metadata["inputs"]
        unsized = sorted({d for spec in declared for d in spec["shape"]
                          if not str(d).isdigit()})
        if unsized:  # its ops' sizes (zeros(shape=[B, T, ..]), views) stay symbols: exit 101
            raise RuntimeUserError(
                f"{self.path} was built without sizes for {', '.join(unsized)}: an IR "
                "document runs at the sizes it was built for",
                help=[f"rebuild it with {' '.join(f'--shape {d}=N' for d in unsized)}, or "
                      "run the .module (it builds at the batch's sizes)"])
        for spec in declared:
            want = [int(d) for d in spec["shape"]] if all(
                d.isdigit() for d in spec["shape"]) else None
            given = inputs.get(spec["name"])
            got = list(given.shape) if given is not None else None
            if want is not None and got is not None and want != got:
                raise RuntimeUserError(
                    f"input `{spec['name']}` has shape {got}; {self.path} was built for "
                    f"{want}", help=["rebuild with other --shape sizes, or run the .module"])
        bind_dims(declared, inputs)  # missing and unknown inputs
        return program


def tp_section(document: dict) -> dict:
    """An IR document's `tensor_parallel` section (`modulec build --tp M [--sp]`: its
    size, sequence_parallel, shards and vocab_outputs); {} without one. The one place
    the runtime reads it."""
    return document.get("schedule", {}).get("tensor_parallel") or {}


def tp_size(document: dict) -> int:
    """An IR document's tensor-parallel size (its `tensor_parallel` section; 1 without)."""
    return int(tp_section(document).get("size", 1))


def tp_sequence_parallel(document: dict) -> bool:
    """Whether an IR document was built with --sp (its `tensor_parallel` section says)."""
    return bool(tp_section(document).get("sequence_parallel", False))


def tp_overlapped(document: dict) -> bool:
    """Whether an IR document's backward collectives overlap the weight gradients
    (modulec.lower.tp_overlap; built without --no-tp-overlap): its section says."""
    return bool(tp_section(document).get("overlap", False))
