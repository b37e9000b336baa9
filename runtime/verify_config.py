"""The sizes and tolerances of `--verify-backward` for one declaration: its
`verify_backward:` section (spec §9.8.1), then the command line.

    verify_backward:
      epsilon: 1e-6         # central-difference step
      tolerance: 1e-6       # max relative error
      shapes:               # parameters (d_model: 32) and free dims (B: 2) alike
        d_model: 32
        T: 8
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from modulec.syntax import ast as A
from runtime.errors import RuntimeUserError

EPSILON, TOLERANCE = 1e-6, 1e-6
REQUIRED_INT_SIZE = "4"  # an `int` parameter without default, unless the section says
# then these, alike for every such parameter, until one satisfies the constraints
CANDIDATE_SIZES = (4, 8, 16, 2, 32, 64, 6, 12, 3, 1)
# then, for two or more parameters, mixes of these (a head count below the model width:
# GPT2Block with RoPE built at no size alike, its head dim d_model / num_heads being 1)
MIXED_SIZES, MIXED_TRIALS = (2, 4, 8, 16), 64
KEYS = ("epsilon", "tolerance", "shapes")


@dataclass
class VerifyConfig:
    params: frozenset[str]  # the declaration's parameter names
    epsilon: float = EPSILON
    tolerance: float = TOLERANCE
    settings: dict[str, str] = field(default_factory=dict)  # parameters, as source text
    shapes: dict[str, int] = field(default_factory=dict)  # free dims
    # `int` parameters without a default that nobody sized: verify picks their size
    chosen: frozenset[str] = frozenset()
    # free dims the declaration's own `shapes:` sizes: each must be a dim of its inputs
    section_dims: frozenset[str] = frozenset()

    def set(self, name: str, text: str) -> None:
        if name in self.params:
            self.settings[name] = text
            self.chosen -= {name}
        elif whole(text):
            self.shapes[name] = int(text)
        else:
            raise RuntimeUserError(f"`{name}: {text}`: a dim size must be an integer")

    def merged(self, options) -> "VerifyConfig":
        """The command line over the section: --set, --shape, --epsilon, --tolerance."""
        merged = VerifyConfig(self.params, self.epsilon, self.tolerance, dict(self.settings),
                              dict(self.shapes), self.chosen, self.section_dims)
        for name, text in options.settings.items():
            if name in self.params or whole(str(text)):
                merged.set(name, str(text))  # else: another declaration's parameter
        merged.shapes.update(options.shapes)
        merged.epsilon = options.epsilon or merged.epsilon
        merged.tolerance = options.tolerance or merged.tolerance
        return merged

    def with_size(self, size: int) -> "VerifyConfig":
        """Every chosen parameter at `size`."""
        return self.with_sizes({name: size for name in self.chosen})

    def with_sizes(self, sizes: dict[str, int]) -> "VerifyConfig":
        """The chosen parameters at these sizes."""
        settings = dict(self.settings) | {name: str(size) for name, size in sizes.items()}
        return VerifyConfig(self.params, self.epsilon, self.tolerance, settings,
                            dict(self.shapes), self.chosen, self.section_dims)


def whole(text: str) -> bool:
    """ASCII digits, maybe after a `-`: `str.isdigit` is true of `²`, which int() refuses
    (`--set B=²` exited 101)."""
    return re.fullmatch(r"-?[0-9]+", text) is not None


def declaration_config(decl: A.Decl) -> VerifyConfig:
    config = VerifyConfig(frozenset(p.name for p in decl.params or ()))
    for param in decl.params or ():  # `Linear(in_dim: int, ...)`: a size to choose
        if param.default is None and isinstance(param.type, A.Name) and param.type.id == "int":
            config.settings[param.name] = REQUIRED_INT_SIZE
            config.chosen |= {param.name}
    for item in decl.body:
        if isinstance(item, A.Section) and _key(item) == "verify_backward":
            for entry in item.body:
                _read(entry, config, decl.name)
    config.section_dims = frozenset(config.shapes)
    return config


def _read(item, config: VerifyConfig, where: str) -> None:
    key = _key(item)
    if key not in KEYS:
        raise RuntimeUserError(f"`verify_backward:` of `{where}` has no setting `{key}`",
                               help=[f"settings: {', '.join(KEYS)}"])
    if isinstance(item, A.Section):
        for entry in item.body:
            config.set(_key(entry), _text(entry.value))
    else:
        setattr(config, key, float(_text(item.value)))


def _key(item) -> str:
    return item.key.id if isinstance(item.key, A.Name) else str(item.key)


def _text(expr) -> str:
    from modulec.syntax.printer import expr as show

    return show(expr)


def mixed_sizes(names) -> list[dict[str, int]]:
    """Sizes for `names` from MIXED_SIZES that are not all alike, small ones first (by
    largest, then total), at most MIXED_TRIALS of them."""
    import itertools

    names = sorted(names)
    if len(names) < 2:
        return []
    mixes = [m for m in itertools.product(MIXED_SIZES, repeat=len(names)) if len(set(m)) > 1]
    mixes.sort(key=lambda m: (max(m), sum(m), m))
    return [dict(zip(names, m)) for m in mixes[:MIXED_TRIALS]]
