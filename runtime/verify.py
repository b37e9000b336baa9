"""`modulec check --verify-backward` (spec §9.8.1): prove each backward right by finite
differences.

For every module, block and model of a file: instantiate it (defaults, then its
`verify_backward:` section, then `--set`/`--shape`), give the dims still free small sizes,
run the forward in float64 on random inputs and parameters, draw a random seed for every
output, run the backward, and compare each input and trainable-parameter gradient g with
central differences of f(theta) = sum <seed, output(theta)>, along random directions v:

    (f(theta + eps v) - f(theta - eps v)) / 2 eps   vs   <g, v>

Directional checks cost two forwards per direction and tensor instead of two per element,
so whole models are checked; a wrong gradient (swapped outputs, a wrong scale, a missing
accumulate) differs from the true one in some direction, which a random v finds with
probability one. `@gradient` ops run as surrogates with the derivative the annotation
asks for (runtime.gradient_marks); frozen parameters have no gradient to check. A
declaration whose source writes a backward is checked twice: as written, and with the
backward derived from the primitives' rules.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from modulec.check.given import FREE_DIM_SIZES, OTHER_DIM_SIZE, VERIFY_MAX_ELEMENTS
from modulec.check.verify_sizes import largest_value
from runtime.errors import RuntimeUserError
from runtime.gradient_marks import GradientMarks
from runtime.train.param_groups import frozen_parameters
from runtime.model import Model, parameter_shapes
from runtime.program import ModuleSource
from runtime.verify_config import (CANDIDATE_SIZES, MIXED_SIZES, VerifyConfig,
                                   declaration_config, mixed_sizes)

STAR_SHAPE = (2, 3)  # the leading dims given to a `[*, d]` input
MAX_ELEMENTS = VERIFY_MAX_ELEMENTS  # parameters and the largest value
EPS64 = 2.0 ** -52
ROUNDING_FACTOR = 4  # f(theta + eps v) and f(theta - eps v), each rounded, and their sum  # parameters: beyond this, finite differences take too long


@dataclass
class GradientCheck:
    declaration: str
    backward: str  # "derived" | "written" | "derived (rewritten)"
    gradient: str  # `d_x` for an input, `d_<param path>` for a parameter
    error: float | None  # max relative error over the directions (None: not run)
    ok: bool
    note: str = ""


@dataclass
class VerifyOptions:
    settings: dict[str, str] = field(default_factory=dict)
    shapes: dict[str, int] = field(default_factory=dict)
    epsilon: float | None = None  # None: the declaration's, else 1e-6
    tolerance: float | None = None
    directions: int = 2
    seed: int = 0
    search_path: tuple[Path, ...] = ()
    # the input dims of every declaration verified (a --shape naming none sized nothing)
    seen_dims: set = field(default_factory=set)


def verify_declaration(path: Path, decl, options: VerifyOptions) -> list[GradientCheck]:
    # the tensors are tiny: threads cost more than they give (and spin on a busy machine)
    torch.set_num_threads(1)
    config = _sized(path, decl.name, declaration_config(decl).merged(options), options)
    checks = []
    try:
        for source, label in _variants(path, decl.name, config, options):
            checks += _verify_variant(source, decl.name, config, options, label)
    except RuntimeError as exc:  # torch.OutOfMemoryError too; a kernel's workspace (the
        # reference attention's [B, H, T, T] scores) is no graph value _check_activations sees
        if "can't allocate memory" not in str(exc) and \
                not isinstance(exc, getattr(torch, "OutOfMemoryError", ())):
            raise
        asked = re.search(r"allocate (\d+) bytes", str(exc))
        raise RuntimeUserError(
            f"`{decl.name}` ran out of memory at these sizes" +
            (f" (a kernel asked for {int(asked.group(1)) / 2**30:,.1f} GiB)" if asked else ""),
            help=["give it small sizes in a `verify_backward:` section (`shapes:`) or with "
                  "--set and --shape"]) from None
    return checks


def _sized(path, name: str, config: VerifyConfig, options) -> VerifyConfig:
    """Sizes for the `int` parameters nobody sized that satisfy the declaration's
    constraints (tried alike: 4, 8, 16, ...; then, for several, mixes of small sizes);
    when none does, say which to size."""
    if not config.chosen:
        return config
    first = None
    trials = [config.with_size(size) for size in CANDIDATE_SIZES] + \
        [config.with_sizes(sizes) for sizes in mixed_sizes(config.chosen)]
    for trial in trials:
        try:
            _source(path, name, trial, options, False).program(trial.shapes, planned=False)
            return trial
        except RuntimeUserError as exc:
            first = first or exc
    names = " and ".join(f"`{n}`" for n in sorted(config.chosen))
    sizes = ", ".join(map(str, CANDIDATE_SIZES))
    mixes = len(trials) - len(CANDIDATE_SIZES)
    raise RuntimeUserError(
        f"`{name}` does not build with {names} at any of the sizes {sizes}" +
        (f", nor at {mixes} mixes of {', '.join(map(str, MIXED_SIZES))}" if mixes else ""),
        help=[f"give {names} sizes that satisfy the constraints in a `verify_backward:` "
              "section (`shapes:`) or with --set NAME=VALUE", *first.help])


def _variants(path, name, config, options) -> list[tuple[ModuleSource, str]]:
    """The program as built, plus the one with every backward derived when that differs
    (the source writes a backward somewhere in the tree)."""
    built = _source(path, name, config, options, False)
    derived = _source(path, name, config, options, True)
    if built.program(config.shapes).document["graph"] == \
            derived.program(config.shapes).document["graph"]:
        return [(built, "derived")]
    return [(built, "written"), (derived, "derived")]


def _source(path, name, config: VerifyConfig, options, derive: bool) -> ModuleSource:
    return ModuleSource(Path(path), dict(config.settings), None, name,
                        tuple(options.search_path), derive_written=derive)


def _verify_variant(source: ModuleSource, name, config, options, label: str):
    probe = source.program(config.shapes)
    declared = source.program(planned=False).metadata["inputs"]  # dims by name
    options.seen_dims.update(d for spec in declared for d in spec["shape"])
    _section_dims_used(config, name, {d for spec in declared for d in spec["shape"]})
    shapes = dict(config.shapes) | _free_dims(probe.metadata["inputs"], config.shapes)
    model = Model(source, dtype=torch.float64)
    model.program = source.program(shapes)
    sizes = parameter_shapes(model.program.graph)
    _check_size(sizes, name)
    _check_activations(model.program, name)
    generator = torch.Generator().manual_seed(options.seed)
    model.params = _random_params(sizes, generator)
    inputs = _random_inputs(model.program.metadata["inputs"], shapes, generator, sizes)
    return _Checker(model, inputs, config, options, generator, name, label).run()


def _section_dims_used(config: VerifyConfig, name: str, dims: set) -> None:
    """A `shapes:` line that names neither a parameter nor a dim of the inputs sized
    nothing (found by the fuzz run: `T: 6` renamed `graph: 6` verified at T = 4)."""
    stray = sorted(config.section_dims - dims)
    if stray:
        known = ", ".join(sorted(d for d in dims if d.isidentifier())) or "none"
        raise RuntimeUserError(
            f"`verify_backward:` of `{name}` sizes `{stray[0]}`, which is neither a "
            f"parameter of `{name}` nor a dim of its inputs",
            help=[f"its parameters: {', '.join(sorted(config.params)) or 'none'}; "
                  f"its inputs' dims: {known}"])


def _free_dims(declared: list[dict], given: dict) -> dict[str, int]:
    free = {}
    for spec in declared:
        for dim in spec["shape"]:
            if dim.isidentifier() and dim not in given:
                free[dim] = FREE_DIM_SIZES.get(dim, OTHER_DIM_SIZE)
    return free


def _check_size(shapes: dict, name: str) -> None:
    for path, shape in shapes.items():
        unsized = [d for d in shape if not isinstance(d, int)]
        if unsized:
            raise RuntimeUserError(f"parameter `{path}` of `{name}` has no size for "
                                   f"{', '.join(map(str, unsized))}",
                                   help=["give the declaration's parameters values in a "
                                         "`verify_backward:` section or with --set"])
    elements = sum(torch.Size(s).numel() for s in shapes.values())
    if elements > MAX_ELEMENTS:
        raise RuntimeUserError(
            f"`{name}` has {elements:,} parameters at these sizes: too many to check by "
            "finite differences", help=["give it small sizes in a `verify_backward:` section "
                                        "(`shapes:` sets parameters and dims) or with --set"])


def _check_activations(program, name: str) -> None:
    """The largest forward value at these sizes (or the reference attention's scores),
    bounded as the parameters are, by the rule `check` applies at the `verify_backward:`
    sizes (modulec.check.verify_sizes.largest_value; found by a fuzz run: std
    DenseTransformerBlock's `T: 6` made `T: 100000` tried to allocate a 640 GB score
    matrix, and the allocator's error was an internal error, exit 101)."""
    largest = largest_value(program.graph)
    if largest is not None and math.prod(largest[1]) > MAX_ELEMENTS:
        value, shape = largest
        raise RuntimeUserError(
            f"`{name}` computes `{value}` {shape} ({math.prod(shape):,} elements) at "
            "these sizes: too large to check by finite differences",
            help=["give it small sizes in a `verify_backward:` section (`shapes:` sets "
                  "parameters and dims) or with --set and --shape"])


def _random_params(shapes: dict, generator) -> dict:
    params = {}
    for path, shape in shapes.items():
        value = torch.randn(shape, generator=generator, dtype=torch.float64) * 0.5
        if len(shape) == 1 and path.endswith("weight"):
            value = value * 0.2 + 1.0  # norm scales near one, as trained ones are
        params[path] = value
    return params


def _random_inputs(declared: list[dict], shapes: dict, generator,
                   parameters: dict | None = None) -> dict:
    """Random inputs of the declared shapes; ids (int inputs) are 0 and 1, or only 0 where
    a parameter has a single row (`parameters`: path -> shape; a vocabulary of one made
    id 1 index past the embedding table, an IndexError in the forward)."""
    ids = _id_bound(parameters or {})
    inputs = {}
    for spec in declared:
        shape = []
        for dim in spec["shape"]:
            shape += list(STAR_SHAPE) if dim == "*" else [int(shapes.get(dim, dim))]
        if spec["dtype"].startswith("int"):
            inputs[spec["name"]] = torch.randint(0, ids, shape, generator=generator,
                                                 dtype=torch.int32)
        else:
            inputs[spec["name"]] = torch.randn(shape, generator=generator, dtype=torch.float64)
    return inputs


def _id_bound(parameters: dict) -> int:
    """2 (ids 0 and 1), or 1 where some parameter's first dimension is 1: whichever table
    an id indexes (an embedding, a head's classes) is a parameter, and its rows its first
    dimension, so ids below the smallest first dimension index every table."""
    rows = [int(shape[0]) for shape in parameters.values() if len(shape) > 0]
    return 1 if rows and min(rows) < 2 else 2


@dataclass
class _Checker:
    model: Model
    inputs: dict
    config: VerifyConfig
    options: VerifyOptions
    generator: torch.Generator
    name: str
    label: str

    def run(self) -> list[GradientCheck]:
        marks = GradientMarks(self.model.hooks)  # records x0, then f, for the surrogates
        self.model.hooks = marks
        outputs = self._forward(self.inputs, self.model.params)
        self.seeds = {k: torch.randn(v.shape, generator=self.generator, dtype=torch.float64)
                      for k, v in outputs.items() if v.is_floating_point()}
        # rounding of f(theta +- eps v) in float64: the finite difference cannot resolve
        # less than this (absolute), whatever the gradient
        magnitude = sum(float((self.seeds[k] * outputs[k]).abs().sum()) for k in self.seeds)
        self.noise = ROUNDING_FACTOR * EPS64 * magnitude / self.config.epsilon
        self._forward(self.inputs, self.model.params)
        grads = self.model.backward(**self.seeds)
        marks.surrogate = True
        checks = [self._check(f"d_{n}", grads.inputs.get(n), n, None)
                  for n, x in self.inputs.items() if x.is_floating_point()]
        frozen = frozen_parameters(self.model.program)  # no gradient, by design
        checks += [GradientCheck(self.name, self.label, f"d_{p}", None, True, "frozen")
                   if p in frozen else self._check(f"d_{p}", grads.params.get(p), None, p)
                   for p in self.model.params]
        return checks

    def _forward(self, inputs, params) -> dict:
        self.model.params = params
        return self.model.forward(**inputs)

    def _objective(self, inputs, params) -> float:
        outputs = self._forward(inputs, params)
        return sum(float((self.seeds[k] * outputs[k]).sum()) for k in self.seeds)

    def _check(self, gradient: str, analytic, input_name, param) -> GradientCheck:
        base = self.inputs[input_name] if input_name else self.model.params[param]
        worst, ok = 0.0, True
        params = dict(self.model.params)
        for _ in range(self.options.directions):
            direction = torch.randn(base.shape, generator=self.generator, dtype=torch.float64)
            direction /= direction.norm().clamp_min(1e-300)
            numeric = self._directional(input_name, param, params, base, direction)
            exact = float((analytic * direction).sum()) if analytic is not None else 0.0
            worst = max(worst, _relative(numeric, exact))
            scale = max(abs(numeric), abs(exact))
            ok &= abs(numeric - exact) <= self.config.tolerance * scale + self.noise
        self.model.params = params
        note = "" if analytic is not None else "no gradient flows back" if ok else \
            "no gradient computed"
        return GradientCheck(self.name, self.label, gradient, worst, ok, note)

    def _directional(self, input_name, param, params, base, direction) -> float:
        eps = self.config.epsilon
        values = []
        for sign in (1.0, -1.0):
            moved = base + sign * eps * direction
            inputs = self.inputs | ({input_name: moved} if input_name else {})
            values.append(self._objective(inputs, params | ({param: moved} if param else {})))
        return (values[0] - values[1]) / (2 * eps)


def _relative(numeric: float, exact: float) -> float:
    scale = max(abs(numeric), abs(exact))
    return 0.0 if scale < 1e-12 else abs(numeric - exact) / scale
