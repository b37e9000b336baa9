"""LoRA under tensor parallel (`--tp M [--sp] --lora`): where each adapter matrix lives and
which collective it needs (docs/decisions.md, "LoRA under tensor parallel").

The `lora` pass runs after `tensor_parallel` and `sequence_parallel`, on one rank's
program. A column-parallel matmul (W split by output rows: q, k, v, gate, up) reads the
region's replicated input x (its `tp_copy`, `sp_all_gather` with `--sp`) and makes this
rank's rows of y; a row-parallel one (W split by input columns: o, down) reads this
rank's columns of x and makes a partial sum, which the `tp_all_reduce` (`sp_reduce_scatter`)
after it adds up. The adapter `y += s (x A^T) B^T` goes inside the region:

- column: A [r, in] whole on every rank, B [out, r] split by rows as W is (a part of a
  fused weight: block r of its own rows), so the delta is this rank's rows of y's delta.
  d_h = s d_y_rank B_rank is one rank's share of d_h, so A's gradient is a partial sum:
  A is read through a `tp_copy` (identity forward, all-reduce of d_A backward), the rule
  the tensor_parallel pass gives any replicated parameter read inside a region. The
  adapter's d_x (a share too) joins the base's, which the region's own `tp_copy` sums.
- row: A [r, in] split by columns as W is, B [out, r] whole: h_rank = x_rank A_rank^T is
  a partial sum of h, and s h_rank B^T is added to the rank's partial y before the
  reduction sums it (B is linear). d_h = s d_y B is whole on every rank, so A's slice of
  the gradient is exact; B's, s d_y^T h_rank, is a partial sum: B is read through a
  `tp_copy`.

Each backward collective is one adapted projection's d_A ([k*r, in], a fused weight's k
parts at once) or d_B ([out, r]): small, and the same size at any batch. The adapters'
shards join the `tensor_parallel` section, so the runtime slices, initializes, joins and
saves them as it does the base weights.
"""

from __future__ import annotations

from modulec.lower.tensor_parallel import Shard

COLUMN = ("column", "vocab")  # split by output rows (a vocab-parallel head is one too)


def weight_shard(plan, site) -> Shard | None:
    """The adapted weight's shard (None: replicated, or no tensor parallel)."""
    if plan is None or plan.size == 1:
        return None
    return plan.shards.get(site.function, {}).get(site.weight)


def problem(site, shape: tuple) -> str | None:
    """Why the adapters of `site` (its weight of local `shape`) cannot split as its
    weight does, or None."""
    shard = site.shard
    if len(shape) != 2:
        return f"its weight has {len(shape)} dims, not [out, in]"
    want = 0 if shard.strategy in COLUMN else 1
    if shard.dim != want:
        return f"its weight is split along dim {shard.dim}, not {want}"
    if shard.strategy in COLUMN and len(site.parts) > 1:
        rows = [p.rows for p in site.parts]
        local = [p // shard.size for p in shard.parts]
        if rows != local:
            return (f"its parts ({', '.join(p.name for p in site.parts)}: {rows} rows a "
                    f"rank) are not the parts of its `@shard` ({local} rows a rank)")
    return None


def replicated(site) -> str | None:
    """The adapter matrix read inside the region whole on every rank (`lora_A` of a
    column-parallel weight, `lora_B` of a row-parallel one): its gradient is summed over
    the ranks by a `tp_copy`. None without tensor parallel."""
    if site.shard is None:
        return None
    return "lora_A" if site.shard.strategy in COLUMN else "lora_B"


def adapter_shards(site, part, a: str, b: str) -> dict:
    """param id -> Shard of the adapter matrices `a`, `b` of `part` that are split."""
    shard = site.shard
    if shard is None:
        return {}
    if shard.strategy in COLUMN:
        parts = shard.parts if len(site.parts) == 1 else \
            (shard.parts[site.parts.index(part)],)
        return {b: Shard("column", 0, tuple(parts), shard.size)}
    return {a: Shard("row", 1, shard.parts, shard.size)}


def whole_rows(site, part) -> tuple[int, int]:
    """[start, end) of `part` in the whole weight's rows (the metadata's `rows`)."""
    shard = site.shard
    if shard is None or shard.strategy not in COLUMN:
        return part.start, part.start + part.rows
    if len(site.parts) == 1:
        return 0, sum(shard.parts)
    index = site.parts.index(part)
    start = sum(shard.parts[:index])
    return start, start + shard.parts[index]
