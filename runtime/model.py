"""The Python API of the reference runtime.

    from runtime import Model
    model = Model.from_module("std/models/llama.module", hf_weights="ckpt/", dtype=torch.float64)
    out = model.forward(token_ids=ids)              # {"logits": tensor}
    grads = model.backward(logits=d_logits)        # parameter gradients by path
    model.hf_gradients()                           # the same under HF checkpoint names

A model holds its parameters by path (`blocks[3].attention.qkv_weight`) and builds its
program for the shapes of the inputs it is given (see runtime.program).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from modulec.ir.graph import Graph
from runtime.errors import RuntimeUserError
from runtime.hooks import Hooks
from runtime.interpreter import Frame, Interpreter, _join, child_path
from runtime.memory_check import check_memory
from runtime.program import ModuleSource, Program


@dataclass
class Gradients:
    inputs: dict[str, Tensor]  # by input name (floating inputs only)
    params: dict[str, Tensor]  # by parameter path


@dataclass
class Model:
    source: ModuleSource
    params: dict[str, Tensor] = field(default_factory=dict)
    dtype: torch.dtype = torch.float64
    device: str = "cpu"
    hooks: object = None  # runtime.hooks.Hooks (made by default): hooks, probes, trace
    check_finite: bool = True
    arena: bool = False  # run on the memory plan (runtime.arena), in the IR's dtypes
    profiler: object = None  # runtime.profiling.Profiler while profiling is on
    program: Program | None = None
    hf_layout: dict = field(default_factory=dict)  # part sizes of fused HF tensors
    frame_events: object = None  # runtime.dist.zero.ZeroRun under data parallel (ZeRO-3)
    rng_seed: int | None = None  # random ops (dropout): None off (inference), else seeded
    tp_rank: int = 0  # this process's rank in the tensor-parallel group (`tensor_parallel`)
    fp8: object = None  # runtime.fp8.Fp8State: the amax histories of an FP8 recipe
    _frame: Frame | None = None

    def __post_init__(self):
        if self.hooks is None:
            self.hooks = Hooks(points=lambda: self.source.program(planned=False).metadata["hook_points"])

    @property
    def probes(self) -> dict:
        """What `@probe`s captured, by (probe name, layer); see `hooks.enable_probes()`."""
        return self.hooks.probes

    @classmethod
    def from_module(cls, path, *, settings: dict | None = None, config=None, hf_weights=None,
                    dtype=torch.float64, device="cpu", model: str | None = None,
                    search_path=(), progress: bool = False,
                    memory_budget: int | None = None, lora=None,
                    tensor_parallel: int = 1, tp_rank: int = 0,
                    sequence_parallel: bool = False, tp_overlap: bool = True,
                    max_memory: int | None = None,
                    precision: str | None = None,
                    precision_overrides: dict | None = None) -> "Model":
        """A model from a `.module` file; with `hf_weights` (a checkpoint directory) its
        config.json sizes the model (unless `config` names another) and its safetensors
        are loaded. `lora` (a dict `rank=8, alpha=16, targets=["q", "v"]`, `{}` for the
        annotations' values, or modulec.lower.lora.LoraOptions) adapts the model's
        `@adapter(lora)` matmuls and freezes its base weights (docs/training.md, "LoRA").
        `tensor_parallel=M` builds rank `tp_rank`'s program of M (its `@shard` parameters
        are its slices; docs/distributed.md, "Tensor parallel"); run it in a
        torch.distributed group of M ranks (runtime.kernels.comm.set_tp_group);
        `sequence_parallel=True` (`--sp`) splits the values between its sharded regions
        along the sequence (docs/distributed.md, "Sequence parallel"); `tp_overlap=False`
        (`--no-tp-overlap`) leaves the backward collectives in order. Before
        any weight is made, the model's memory is checked against the device (or
        `max_memory` bytes): runtime.memory_check. `precision="fp8"` applies the std FP8
        recipe (runtime/fp8.py), `precision_overrides` its --fp8-* changes
        (modulec.lower.fp8_recipe.std_recipe)."""
        if hf_weights is not None and config is None and (Path(hf_weights) / "config.json").exists():
            config = Path(hf_weights) / "config.json"
        texts = {k: _setting_text(v) for k, v in (settings or {}).items()}
        source = ModuleSource(Path(path), texts,
                              Path(config) if config else None, model,
                              tuple(Path(p) for p in search_path))
        if lora is not None:
            from modulec.lower.lora import LoraOptions

            try:
                source.lora = LoraOptions.of(lora)
            except ValueError as exc:
                raise RuntimeUserError(f"lora: {exc}") from None
        source.tensor_parallel = int(tensor_parallel)
        source.sequence_parallel = bool(sequence_parallel)
        source.tp_overlap = bool(tp_overlap)
        source.precision = precision
        source.precision_overrides = precision_overrides
        if memory_budget is not None:  # keep / recompute / swap as the planner decides
            from modulec.lower.build_plan import PlanOptions

            source.planning = PlanOptions(budget=int(memory_budget),
                                          training="lora" if lora is not None else "full")
        instance = cls(source, dtype=dtype, device=device, tp_rank=int(tp_rank))
        check_memory(instance, max_memory)
        if hf_weights is not None:
            instance.load_hf(hf_weights, progress=progress)
        return instance

    @classmethod
    def from_ir(cls, path, *, hf_weights=None, dtype=torch.float64, device="cpu",
                progress: bool = False, max_memory: int | None = None,
                tp_rank: int = 0) -> "Model":
        """A model from an IR document written by `modulec build -o` (fixed sizes),
        verified and its memory checked before any weight is made. A document built
        with `--tp M` is one rank's program: `tp_rank` says which rank's slices of the
        weights it loads (run it in a TP group of M: runtime.kernels.comm)."""
        from runtime.program import IRSource

        source = IRSource(Path(path))
        source.program()  # read and verified first: a refused document makes no tensor
        instance = cls(source, dtype=dtype, device=device, tp_rank=int(tp_rank))
        check_memory(instance, max_memory)
        if hf_weights is not None:
            instance.load_hf(hf_weights, progress=progress)
        return instance

    # ------------------------------------------------------------------ parameters
    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        return parameter_shapes(self.source.program(planned=False).graph)

    def parameter_dtypes(self) -> dict[str, torch.dtype]:
        return parameter_dtypes(self.source.program(planned=False).graph, self.dtype)

    def init_random(self, seed: int = 0, std: float = 0.02) -> "Model":
        """Random parameters (normal(0, std); norm weights near 1) for tests and tutorials;
        LoRA adapters as PEFT does (B = 0: the adapted model is the base model), drawn
        after the base weights, which are the same as without LoRA."""
        from modulec.lower.lora import is_adapter
        from runtime.lora import init_adapters

        generator = torch.Generator().manual_seed(seed)
        dtypes = self.parameter_dtypes()
        for path, shape in self.parameter_shapes().items():
            if is_adapter(path):
                continue
            value = torch.randn(shape, generator=generator, dtype=torch.float64) * std
            if len(shape) == 1 and path.endswith("weight"):
                value += 1.0
            self.params[path] = value.to(dtypes[path]).to(self.device)
        init_adapters(self, generator)
        return self

    def load_hf(self, directory, progress: bool = False) -> "Model":
        from runtime.hf_weights import load_hf_weights

        program = self.source.program(planned=False)
        schema = program.weight_schema
        loaded = load_hf_weights(schema, Path(directory), dtype=self.dtype, device=self.device,
                                 progress=progress)
        if any(e.get("shard") for e in schema):  # tensor parallel: this rank's slices
            from runtime.tensor_parallel import local_layout, shard_params

            layout = local_layout(loaded.layout, schema)
            loaded = shard_params(loaded, program, self.tp_rank)
        else:
            layout = loaded.layout
        dtypes = self.parameter_dtypes()  # `@dtype(T)` parameters are stored in T
        self.params.update({p: t.to(dtypes.get(p, t.dtype)) if t.is_floating_point() else t
                            for p, t in loaded.items()})
        self.hf_layout.update(layout)
        from runtime.lora import init_adapters

        init_adapters(self, only_missing=True)  # a LoRA build: fresh adapters (B = 0)
        return self

    # ------------------------------------------------------------------ running
    def forward(self, **inputs: Tensor) -> dict[str, Tensor]:
        self.program = self.source.program_for(inputs)
        self.hooks.set_points(self.program.metadata.get("hook_points", ()))
        names = self.program.input_names()
        values = [self._input(inputs[n]) for n in names]
        outputs, self._frame = self._interpreter().forward(values)
        return dict(zip(self.program.output_names(), outputs))

    def backward(self, **d_outputs: Tensor) -> Gradients:
        """Gradients for output seeds by output name (`logits=d_logits`); an output not
        given is seeded with zeros."""
        if self._frame is None:
            raise RuntimeUserError("backward before forward", help=["call forward first"])
        names = self.program.output_names()
        unknown = set(d_outputs) - set(names)
        if unknown:
            raise RuntimeUserError(f"no output named {', '.join(sorted(unknown))}",
                                   help=[f"outputs: {', '.join(names)}"])
        seeds = [self._input(d_outputs[n]) if n in d_outputs else None for n in names]
        d_inputs, grads = self._interpreter().backward(self._frame, seeds)
        inputs = dict(zip(self.program.input_names(), d_inputs))
        return Gradients({k: v for k, v in inputs.items() if v is not None}, grads)

    def hf_tensors(self) -> dict[str, Tensor]:
        """The parameters under HF checkpoint names (fused tensors split, transforms
        inverted)."""
        from runtime.hf_weights import export_hf_tensors

        return export_hf_tensors(self._schema(), self.params, layout=self.hf_layout)

    def hf_gradients(self, grads: Gradients) -> dict[str, Tensor]:
        """Parameter gradients under HF checkpoint names (tied gradients summed)."""
        from runtime.hf_weights import export_hf_tensors

        return export_hf_tensors(self._schema(), grads.params, gradients=True,
                                 layout=self.hf_layout, weights=self.params)

    def save_hf(self, directory, config: dict | None = None):
        from runtime.hf_weights import save_hf_weights

        return save_hf_weights(self._schema(), self.params, directory, config,
                               layout=self.hf_layout)

    def _schema(self) -> list:
        schema = (self.program or self.source.program(planned=False)).weight_schema
        if any(e.get("shard") for e in schema):  # tensor parallel: this rank's slices
            from runtime.tensor_parallel import local_schema

            return local_schema(schema)
        return schema

    def _interpreter(self) -> Interpreter:
        arena = self._arena()
        regions = self._param_regions() if arena is not None else None
        return Interpreter(self.program.graph, self.params, self.dtype, self.hooks,
                           self.check_finite, arena=arena, decisions=self._decisions(),
                           param_regions=regions, profiler=self.profiler,
                           frame_events=self.frame_events, rng_seed=self.rng_seed,
                           fp8=self.fp8_state())

    def fp8_state(self):
        """The program's FP8 recipe state (runtime.fp8), None without a recipe: made once,
        kept across the programs built for other input sizes."""
        if self.fp8 is None:
            program = self.program or self.source.program(planned=False)
            section = program.metadata.get("precision")
            if section is not None:
                from runtime.fp8 import Fp8State

                self.fp8 = Fp8State(section)
        return self.fp8

    # ------------------------------------------------------------------ profiling
    def enable_profiling(self) -> "Model":
        """Time the `@profile` regions of the model (runtime.profiling); off by default."""
        from runtime.profiling import Profiler

        self.profiler = Profiler()
        return self

    def disable_profiling(self) -> None:
        self.profiler = None

    def profile_report(self) -> list[dict]:
        if self.profiler is None:
            raise RuntimeUserError("profiling is off", help=["call enable_profiling() first"])
        return self.profiler.report()

    def _param_regions(self):
        """On the arena, the parameters live in one weights buffer (rebound when the dict
        of parameters changes) and their gradients in one gradients buffer."""
        from runtime.arena import ParameterRegions

        regions = self.__dict__.get("_regions")
        if regions is None or set(regions.offsets) != set(self.params) or any(
                self.params[p].data_ptr() != regions.weights.data_ptr() + o
                for p, (o, _) in regions.offsets.items()):
            regions = ParameterRegions.for_params(self.params, self.device)
            self.params.update(regions.bind(self.params))
            self.__dict__["_regions"] = regions
        return regions

    def _decisions(self):
        """The planner's recompute / swap decisions of this program, executed."""
        from runtime.decisions import Decisions

        cache = self.__dict__.setdefault("_decision_cache", {})
        if id(self.program) not in cache:
            schedule = self.program.document.get("schedule", {})
            cache[id(self.program)] = Decisions.from_schedule(schedule)
        return cache[id(self.program)]

    def _arena(self):
        if not self.arena:
            return None
        if getattr(self, "_arenas", None) is None:
            self._arenas = {}
        if id(self.program) not in self._arenas:
            from runtime.arena import Arena

            layout = self.program.document["schedule"].get("layout", {})
            self._arenas[id(self.program)] = Arena(self.program.graph, layout, self.device)
        return self._arenas[id(self.program)]

    def _input(self, tensor: Tensor) -> Tensor:
        tensor = torch.as_tensor(tensor).to(self.device)
        return tensor.to(self.dtype) if tensor.is_floating_point() else tensor


def _setting_text(value) -> str:
    """A setting as the DSL writes it: Python's True is `true` (`str(False)` was the word
    `False`, refused as a bool; it used to count as true)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def parameter_shapes(graph: Graph) -> dict[str, tuple[int, ...]]:
    """Every parameter of the model by path, with its shape, walking the calls."""
    infos: dict = {}
    _walk(graph, graph.function(graph.entry), "", (), infos)
    return {path: tuple(_size(d) for d in info.shape) for path, info in infos.items()}


def parameter_dtypes(graph: Graph, run: torch.dtype) -> dict[str, torch.dtype]:
    """Every parameter's dtype in a run in `run`: a float64 or float32 run is exact (all
    in that dtype); otherwise the dtype the program gives a parameter (`@dtype(fp32)`,
    `[d, fp32]`), and `run` where it leaves it to the precision policy."""
    infos: dict = {}
    _walk(graph, graph.function(graph.entry), "", (), infos)
    return {path: _storage_dtype(info.dtype, run) for path, info in infos.items()}


def _storage_dtype(declared: str, run: torch.dtype) -> torch.dtype:
    from runtime.kernels.utility import TORCH_DTYPES

    if run in (torch.float64, torch.float32):
        return run
    dtype = TORCH_DTYPES.get(declared)
    return dtype if dtype is not None and dtype.is_floating_point else run


def _size(dim: str) -> int | str:
    return int(dim) if dim.isdigit() else dim  # a name: a parameter without a value


def _walk(graph: Graph, function, path: str, indices: tuple, shapes: dict) -> None:
    for param in function.params:
        shapes[_join(path, param.id[len("param:"):])] = param
    for node in function.nodes:
        if node.kind != "call":
            continue
        callee = graph.function(node.target)
        for layer in range(int(node.repeat)):
            inner_path, inner = child_path(callee, path, indices, node, layer)
            _walk(graph, callee, inner_path, inner, shapes)
