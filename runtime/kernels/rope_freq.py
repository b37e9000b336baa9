"""RoPE's inverse frequencies and attention scaling from the rope primitive's params, as
transformers' `ROPE_INIT_FUNCTIONS` compute them (modeling_rope_utils.py), in float64.

The IR states the scaling as the checkpoint's config does (`rope_type`, `factor`, ...:
std/primitives/rope.module); this module is the one place that turns it into numbers,
for the reference kernels and the CUDA wrappers alike (decisions.md, "RoPE scaling").

rotary dims: dim = int(D * partial_rotary_factor) (transformers' truncation); the
frequencies are i = 0, 2, .., dim - 1 over dim, so n = ceil(dim / 2) of them and 2n
channels rotate (an odd dim rounds up, as transformers'), the rest pass through.

`dynamic` and `longrope` depend on the sequence length L = max(position_ids) + 1 (T when
positions are 0 .. T-1), as transformers' `dynamic_rope_update` computes it for a call:
dynamic's base is theta * (factor * max(L, M) / M - (factor - 1))^(dim / (dim - 2)) (M =
max_position_embeddings; for L <= M that is theta, plain RoPE); longrope takes
long_factor when L > original_max_position_embeddings, else short_factor. transformers
also caches a grown dynamic table between calls (a later shorter call above M keeps the
longer call's frequencies); here every call uses its own L.
"""

from __future__ import annotations

import math

import torch

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
# the params that describe the frequencies (everything but the layout)
FREQ_PARAMS = ("theta", "rope_type", "factor", "max_position_embeddings",
               "original_max_position_embeddings", "low_freq_factor", "high_freq_factor",
               "beta_fast", "beta_slow", "truncate", "mscale", "mscale_all_dim",
               "attention_factor", "short_factor", "long_factor", "partial_rotary_factor")


def rotary_dims(D: int, partial_rotary_factor: float = 1.0) -> tuple[int, int]:
    """(dim, n): transformers' rotary dim int(D * factor) and the number of frequencies;
    2n channels of each head rotate."""
    dim = int(D * float(partial_rotary_factor))
    n = (dim + 1) // 2
    if n < 1 or 2 * n > D:
        raise ValueError(f"rope: partial_rotary_factor={partial_rotary_factor} gives "
                         f"{2 * n} rotated channels of a head dim of {D}")
    return dim, n


def _arange(dim: int) -> torch.Tensor:
    return torch.arange(0, dim, 2, dtype=torch.float64) / dim


def _plain(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / theta ** _arange(dim)


def _llama3(inv_freq: torch.Tensor, a: dict, M: int) -> torch.Tensor:
    factor, low = float(a["factor"]), float(a["low_freq_factor"])
    high = float(a["high_freq_factor"])
    old = int(a.get("original_max_position_embeddings") or M)
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_scaling(a: dict, factor: float) -> float:
    if a.get("attention_factor") is not None:
        return float(a["attention_factor"])

    def get_mscale(scale, mscale=1.0):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
    mscale, mscale_all_dim = a.get("mscale"), a.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(get_mscale(factor, float(mscale)) / get_mscale(factor, float(mscale_all_dim)))
    return get_mscale(factor)


def _yarn(a: dict, theta: float, dim: int, M: int) -> tuple[torch.Tensor, float]:
    original = int(a.get("original_max_position_embeddings") or M)
    factor = a.get("factor")
    factor = M / original if factor is None else float(factor)
    beta_fast = float(a.get("beta_fast") or 32)
    beta_slow = float(a.get("beta_slow") or 1)
    truncate = a.get("truncate", True)
    truncate = True if truncate is None else bool(truncate)

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))
    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** _arange(dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) \
        + (1.0 / pos_freqs) * extrapolation
    return inv_freq, _yarn_scaling(a, factor)


def _longrope_scaling(a: dict, M: int) -> float:
    original = int(a.get("original_max_position_embeddings") or M)
    if a.get("attention_factor") is not None:
        return float(a["attention_factor"])
    factor = a.get("factor")
    factor = M / original if factor is None else float(factor)
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _longrope(a: dict, theta: float, dim: int, ext) -> torch.Tensor:
    ext = torch.tensor([float(v) for v in ext], dtype=torch.float64)
    return 1.0 / (ext * theta ** _arange(dim))


def frequencies(attrs: dict, D: int, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq float64 [n] on the CPU, attention_scaling) for a head dim D; seq_len (an
    int) only matters for dynamic and longrope. transformers' formulas, in float64."""
    a = attrs
    kind = a.get("rope_type") or "default"
    theta = float(a.get("theta", 10000.0))
    dim, n = rotary_dims(D, a.get("partial_rotary_factor", 1.0) or 1.0)
    M = a.get("max_position_embeddings")
    M = None if M is None else int(M)
    if kind == "default":
        return _plain(theta, dim), 1.0
    if kind == "linear":
        return _plain(theta, dim) / float(a["factor"]), 1.0
    if kind == "dynamic":
        factor = float(a["factor"])
        L = max(int(seq_len or M), M)
        base = theta * ((factor * L / M) - (factor - 1)) ** (dim / (dim - 2))
        return _plain(base, dim), 1.0
    if kind == "llama3":
        return _llama3(_plain(theta, dim), a, M), 1.0
    if kind == "yarn":
        return _yarn(a, theta, dim, M)
    if kind == "longrope":
        original = int(a.get("original_max_position_embeddings") or M)
        long = seq_len is not None and seq_len > original
        return _longrope(a, theta, dim, a["long_factor" if long else "short_factor"]), \
            _longrope_scaling(a, M)
    raise ValueError(f"rope: rope_type `{kind}` is not one of {', '.join(ROPE_TYPES)}")


def depends_on_length(attrs: dict) -> bool:
    return (attrs.get("rope_type") or "default") in ("dynamic", "longrope")


def device_frequencies(attrs: dict, D: int, T: int, position_ids, device,
                       cache: dict | None = None,
                       dtype=torch.float64) -> tuple[torch.Tensor, float]:
    """(inv_freq [n] in `dtype` on `device`, attention_scaling) for a call: positions
    0 .. T-1 (position_ids None) or position_ids, whose max + 1 is found on the device
    (no host sync, so a captured CUDA graph replays it) for dynamic and longrope.
    `cache`: a dict kept by the caller for the tables that do not depend on the call
    (made once, before a CUDA graph is captured, and reused by it)."""
    key = (tuple((k, _hashable(attrs.get(k))) for k in FREQ_PARAMS), D, str(device), dtype)
    if not depends_on_length(attrs) or position_ids is None:
        full = key + ((T,) if depends_on_length(attrs) else ())
        if cache is not None and full in cache:
            return cache[full]
        inv, scaling = frequencies(attrs, D, T)
        out = (inv.to(device=device, dtype=dtype), scaling)
        if cache is not None:
            cache[full] = out
        return out
    inv, scaling = _length_dependent(attrs, D, position_ids, device, key, cache)
    return inv.to(dtype), scaling


def _length_dependent(attrs, D, position_ids, device, key, cache):
    """dynamic / longrope with position_ids: both candidate tables chosen on the device."""
    if cache is not None and key in cache:
        tables = cache[key]
    else:
        tables = _length_tables(attrs, D, device)
        if cache is not None:
            cache[key] = tables
    L = position_ids.max().to(torch.float64) + 1
    if (attrs.get("rope_type")) == "longrope":
        short, long, scaling, original = tables
        return torch.where(L > original, long, short), scaling
    exponent, theta, factor, M, dim = tables
    L = torch.clamp(L, min=M)
    base = theta * ((factor * L / M) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / base ** exponent, 1.0


def _length_tables(attrs, D, device):
    dim, _ = rotary_dims(D, attrs.get("partial_rotary_factor", 1.0) or 1.0)
    M = int(attrs["max_position_embeddings"])
    if attrs.get("rope_type") == "longrope":
        original = int(attrs.get("original_max_position_embeddings") or M)
        short, scaling = frequencies(attrs, D, None)
        long, _ = frequencies(attrs, D, original + 1)
        return short.to(device), long.to(device), scaling, original
    return (_arange(dim).to(device), float(attrs.get("theta", 10000.0)),
            float(attrs["factor"]), float(M), dim)


def _hashable(value):
    return tuple(value) if isinstance(value, list) else value
