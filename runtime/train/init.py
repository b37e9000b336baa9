"""`modulec train --init random --seed S`: from-scratch weights, as transformers'
`_init_weights` gives a Llama-family model (docs/training.md, "From scratch"):

- every parameter of two or more dimensions (matrices, embeddings, stacked experts):
  normal(0, std), std the config's `initializer_range` (0.02 without one);
- a one-dimensional parameter read as a norm's scale (`rmsnorm`, `layernorm`,
  `fused_residual_rmsnorm`, `qk_norm`, ...): ones, so the norm starts as a plain
  normalization; zeros where the norm scales by `offset + w` (Gemma's `1 + w`);
- any other one-dimensional parameter (biases; an offset read as `1 + w`): zeros;
- an embedding looked up with a `padding_idx`: that row zero (as nn.Embedding's);
- LoRA adapters as PEFT initializes them (runtime.lora.init_adapters); a tied parameter
  (`tied_to`) shares its target's tensor.

The values are drawn in float32 on the CPU from one generator seeded with S, parameter
by parameter in sorted path order, then moved to the run's device: the same seed gives the
same weights on `--device cpu` and `--device cuda`.
"""

from __future__ import annotations

import torch

from modulec.lower.lora import is_adapter
from runtime.interpreter import _join, child_path
from runtime.kernels import KERNELS
from runtime.train.param_groups import EMBEDDINGS

NORM_OPS = frozenset({"rmsnorm", "layernorm", "fused_residual_rmsnorm",
                      "fused_residual_layernorm", "group_rmsnorm", "qk_norm", "qk_norm_rope"})
DEFAULT_STD = 0.02


def init_std(config: dict | None) -> float:
    """The normal's std: the config's `initializer_range`, else 0.02."""
    value = (config or {}).get("initializer_range")
    return float(value) if isinstance(value, (int, float)) and value > 0 else DEFAULT_STD


def standard_values(shapes: dict, norm_weights: dict, seed: int, std: float,
                    padding: dict | None = None) -> dict[str, torch.Tensor]:
    """float32 CPU values by path (adapters left out), drawn in sorted path order.
    `norm_weights`: the start value of each norm scale; `padding`: an embedding's
    padding row (zeroed)."""
    generator = torch.Generator().manual_seed(int(seed))
    values = {}
    for path in sorted(shapes):
        shape = tuple(int(d) for d in shapes[path])
        if is_adapter(path):
            continue
        if len(shape) >= 2:
            values[path] = torch.empty(shape).normal_(0.0, std, generator=generator)
            row = (padding or {}).get(path)
            if row is not None and 0 <= row < shape[0]:
                values[path][row] = 0.0
        elif path in norm_weights and not path.endswith("bias"):
            values[path] = torch.full(shape, float(norm_weights[path]))
        else:
            values[path] = torch.zeros(shape)
    return values


def initialize(model, seed: int, std: float = DEFAULT_STD) -> dict[str, str]:
    """Set `model.params` to the standard init; returns each parameter's rule by path
    ("normal", "ones", "zeros") for notes and tests."""
    from runtime.hf_weights.schema import tied_targets
    from runtime.lora import init_adapters

    program = model.source.program(planned=False)
    shapes = model.parameter_shapes()
    unsized = sorted(p for p, s in shapes.items() if not all(isinstance(d, int) for d in s))
    if unsized:
        raise ValueError(f"parameters without sizes: {unsized[:3]}")
    ties = tied_targets(program.weight_schema)
    owned = {p: s for p, s in shapes.items() if p not in ties}
    scales = norm_scales(program.graph)
    values = _whole_then_sliced(program, owned, scales, seed, std,
                                getattr(model, "tp_rank", 0))
    dtypes = model.parameter_dtypes()
    model.params.update({p: v.to(dtypes[p]).to(model.device) for p, v in values.items()})
    model.params.update({p: model.params[t] for p, t in ties.items()})
    init_adapters(model, torch.Generator().manual_seed(int(seed)), only_missing=True)
    return {p: _rule(v) for p, v in values.items()}


def _whole_then_sliced(program, shapes: dict, scales: dict, seed: int, std: float,
                       tp_rank: int) -> dict[str, torch.Tensor]:
    """The standard values of the whole model, drawn as one process draws them, then (a
    `--tp` rank's program) this rank's slice of each sharded one: every TP rank holds its
    part of the weights the same seed gives without --tp."""
    from runtime.tensor_parallel import shard_params, sharded_paths

    shards = sharded_paths(program)
    whole = {p: _whole_shape(s, shards.get(p)) for p, s in shapes.items()}
    padding = padding_rows(program.graph, 0, whole)  # the whole table's row
    values = standard_values(whole, scales, seed, std, padding)
    return shard_params(values, program, tp_rank) if shards else values


def _whole_shape(shape, shard: dict | None) -> tuple:
    """A rank's parameter shape before its `shard` split dim `dim` into `size` blocks."""
    shape = tuple(int(d) for d in shape)
    if shard is None:
        return shape
    dim = shard["dim"]
    return shape[:dim] + (shape[dim] * shard["size"],) + shape[dim + 1:]


def _rule(value: torch.Tensor) -> str:
    if value.dim() >= 2:
        return "normal"
    return "ones" if bool((value == 1).all()) and value.numel() else "zeros"


def norm_scales(graph) -> dict[str, float]:
    """The parameters some norm op reads as its scale, by path: 1 - the op's `offset`
    (1 for a plain norm, 0 for Gemma's `1 + w`), walking the calls as the runtime does.
    A `--tp` program reads a replicated scale inside a TP region through `tp_copy` (Qwen3's
    q_norm): the norm's input is then the copy's output, followed back to the parameter."""
    found: dict[str, float] = {}
    copies: dict[tuple, str] = {}  # (path, value) -> the parameter a tp_copy passes on

    def visit(node, path: str) -> None:
        if node.target == "tp_copy" and node.inputs[0].startswith("param:"):
            copies.update({(path, o): node.inputs[0] for o in node.outputs})
        if node.target in NORM_OPS:
            start = 1.0 - float(node.attr("offset") or 0.0)
            names = KERNELS[node.target].forward_inputs  # LayerNorm's bias is no scale
            reads = [(name, copies.get((path, v), v)) for name, v in zip(names, node.inputs)]
            found.update({_join(path, v[len("param:"):]): start for name, v in reads
                          if v.startswith("param:") and name != "bias"})
    _walk(graph, graph.function(graph.entry), "", (), visit)
    return found


def padding_rows(graph, tp_rank: int = 0, shapes: dict | None = None) -> dict[str, int]:
    """Embedding tables looked up with a `padding_idx`, by path: that row (of a table split
    over the vocabulary, `--tp`: the local row on rank `tp_rank`, where it is this rank's;
    `shapes` gives the local row counts)."""
    found: dict[str, int] = {}

    def visit(node, path: str) -> None:
        row = node.attr("padding_idx") if node.target in EMBEDDINGS else None
        if isinstance(row, int) and node.target == "vocab_parallel_embedding":
            rows = (shapes or {}).get(_join(path, node.inputs[1][len("param:"):]), (0,))[0]
            row = row - tp_rank * rows if 0 <= row - tp_rank * rows < rows else None
        if isinstance(row, int) and not isinstance(row, bool):
            found.update({_join(path, v[len("param:"):]): row for v in node.inputs
                          if v.startswith("param:")})
    _walk(graph, graph.function(graph.entry), "", (), visit)
    return found


def _walk(graph, function, path: str, indices: tuple, visit) -> None:
    for node in function.nodes:
        if node.kind == "call":
            callee = graph.function(node.target)
            for layer in range(int(node.repeat)):
                inner_path, inner = child_path(callee, path, indices, node, layer)
                _walk(graph, callee, inner_path, inner, visit)
        else:
            visit(node, path)


def check_init(init: str | None, hf_weights, resume, config) -> None:
    """--init random starts from scratch: no --hf-weights, no --resume; --config (the
    sizes of a from-scratch model) only with it. Under --tp each rank draws the whole
    model and keeps its slices (initialize)."""
    from runtime.errors import RuntimeUserError

    if init is None:
        if config is not None:
            raise RuntimeUserError("--config sizes a from-scratch model: give it with "
                                   "--init random", help=["--hf-weights DIR brings its own "
                                                          "config.json"])
        return
    for flag, value in (("--hf-weights", hf_weights), ("--resume", resume)):
        if value is not None:
            raise RuntimeUserError(f"--init random starts from scratch; {flag} gives the "
                                   "weights to start from", help=[f"leave out {flag} or "
                                                                  "--init random"])


def scratch_config(program, std: float) -> dict:
    """A HuggingFace config.json for the checkpoints of a from-scratch run without
    --config: the model's `hf_config` (architecture, config class) and its parameters
    under their HF names (`hf_config.param_mapping`), so transformers loads them."""
    schema = program.document.get("config_schema", {})
    hf, mapping = schema.get("hf", {}), schema.get("param_mapping", {})
    values = program.metadata.get("parameters", {})
    config: dict = {}
    if hf.get("architecture"):
        config["architectures"] = [hf["architecture"]]
    model_type = _model_type(hf.get("config_class"))
    if model_type:
        config["model_type"] = model_type
    for name, field in mapping.items():
        value = _value(values.get(name))
        if value is not None:
            config[field] = value
    config["initializer_range"] = std
    config["torch_dtype"] = "float32"
    return config | _derived(config, [f for f in mapping.values() if f not in config])


def _derived(config: dict, fields: list[str]) -> dict:
    """Fields the model leaves unset (Llama's head_dim: d_model / num_heads) as
    transformers' config class derives them, so a resume reads them back unwarned."""
    try:
        import transformers

        hf = transformers.AutoConfig.for_model(**config)
    except Exception:  # noqa: BLE001 - no transformers, or a model_type it lacks
        return {}
    values = {f: getattr(hf, f, None) for f in fields if "." not in f}
    return {f: v for f, v in values.items() if isinstance(v, (bool, int, float, str))}


def _model_type(config_class: str | None) -> str | None:
    """transformers' `model_type` of a config class (LlamaConfig: llama); without
    transformers, the class name less `Config`, lowercased."""
    if not config_class:
        return None
    try:
        import transformers

        return getattr(transformers, config_class).model_type
    except (ImportError, AttributeError):
        return config_class.removesuffix("Config").lower() or None


def _value(text):
    """A parameter's value from the program's metadata text (None: unset)."""
    if text is None or text == "None":
        return None
    if text in ("True", "False", "true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def scratch_layout(schema: list, config: dict) -> dict[str, list[int]]:
    """The part sizes of each fused parameter (`fuse(...)` in hf_mapping), by concrete
    path, for exporting a model that was never loaded: the shapes of transformers' own
    model for `config`, built on the meta device (no memory)."""
    from runtime.errors import RuntimeUserError
    from runtime.hf_weights.schema import expand

    fused = [e for e in schema if e.get("kind") == "fuse"]
    if not fused:
        return {}
    try:
        import transformers

        hf_config = transformers.AutoConfig.for_model(**config)
        with torch.device("meta"):
            hf_model = transformers.AutoModelForCausalLM.from_config(hf_config)
    except Exception as exc:  # noqa: BLE001 - missing package, unknown model_type, ...
        raise RuntimeUserError(
            f"cannot size the fused tensors of this model's checkpoints: {exc}",
            help=["saving a from-scratch run builds transformers' model for the config "
                  "on the meta device (pip install transformers), or start from "
                  "--hf-weights"]) from None
    shapes = {name: tuple(t.shape) for name, t in hf_model.state_dict().items()}
    layout = {}
    for item in expand(schema):
        names = item.names() if item.kind == "fuse" else []
        if names and all(name in shapes for name in names):
            layout[item.path] = [int(shapes[n][item.entry["dim"]]) for n in names]
    return layout
