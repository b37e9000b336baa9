"""benchmarks/backward_mutants.py: one-step mutants of explicit backward graphs are
generated as described and killed by `check` or `--verify-backward`; a mutant that
changes nothing (an equivalent mutant) survives and is reported, not hidden."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent
MLP = ROOT / "std" / "modules" / "mlp.module"


def _load():
    spec = importlib.util.spec_from_file_location("backward_mutants",
                                                  ROOT / "benchmarks" / "backward_mutants.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["backward_mutants"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


bm = _load()

TIED = """\
module Tied(d: int = 4):
  params:
    w: [d, d]
  forward:
    in: x: [B, d]
    out: y: [B, d]
    graph:
      x -> matmul(w, transpose=NT) -> h
      h -> matmul(w, transpose=NT) -> y
    save: [x, h]
  backward:
    graph:
      (d_y, w) -> matmul(transpose=NN) -> d_h
      (d_y, saved.h) -> matmul(transpose=TN{first}) -> d_w
      (d_h, w) -> matmul(transpose=NN) -> d_x
      (d_h, saved.x) -> matmul(transpose=TN, accumulate=true) -> d_w
"""


def _swiglu():
    return [m for m in bm.generate(MLP) if m.declaration == "SwiGLU_MLP"]


def test_swiglu_mutants_by_kind():
    kinds = Counter(m.kind for m in _swiglu())
    # outputs: 3 pairs of swiglu_backward's (d_gate, d_up, hidden); inputs: 8 pairs over
    # the tuples; 4 matmuls x 2 letters; scale: 4 alphas, a step before d_gate_up, and
    # swiglu_backward's d_hidden (hidden comes back from swiglu_backward: no recompute flow)
    assert kinds == {"swap-outputs": 3, "swap-inputs": 8, "flip-transpose": 8, "scale": 6}
    assert {m.file for m in _swiglu()} == {"std/modules/mlp.module"}
    assert all(m.settings == {} for m in _swiglu())


def test_one_step_edits():
    mutants = {m.description: m for m in _swiglu()}
    original = MLP.read_text(encoding="utf-8")
    swapped = mutants["-> (d_gate <-> d_up)"].text
    assert "swiglu_backward() -> (d_up, d_gate, hidden)" in swapped
    flipped = mutants["matmul: transpose=TN -> TT"].text
    assert len(flipped) == len(original) and flipped.count("transpose=TT") == 1
    scaled = {m.text for m in _swiglu() if m.description == "matmul: alpha x 0.5"}
    assert any("matmul(transpose=NN, alpha=0.5) -> d_hidden" in t for t in scaled)


def test_a_handful_of_swiglu_mutants_are_killed():
    wanted = ["-> (d_gate <-> d_up)", "(d_gate <-> d_up) ->", "matmul: transpose=NN -> NT",
              "matmul: transpose=TN -> NN", "scale(0.5) before -> d_gate_up"]
    chosen = [next(m for m in _swiglu() if m.description == w) for w in wanted]
    chosen.append(next(m for m in _swiglu() if m.kind == "scale" and "alpha" in m.description))
    outcomes = bm.run_all(chosen, jobs=1)
    verdicts = {o.description: o.verdict for o in outcomes}
    assert all(o.killed for o in outcomes), verdicts
    assert verdicts["-> (d_gate <-> d_up)"] == "verify"  # well typed, numerically wrong
    assert verdicts["matmul: transpose=TN -> NN"] == "check"  # a type error
    assert not bm.baseline(chosen)


def test_dropping_a_needed_accumulate_is_a_type_error(tmp_path):
    path = tmp_path / "tied.module"
    path.write_text(TIED.format(first=""), encoding="utf-8")
    drops = [m for m in bm.generate(path) if m.kind == "drop-accumulate"]
    assert len(drops) == 1 and "accumulate" not in drops[0].text.split("d_h, saved.x")[1]
    (outcome,) = bm.run_all(drops, jobs=1)
    assert outcome.verdict == "check" and outcome.detail.startswith("E017")


def test_an_equivalent_mutant_survives_and_is_reported(tmp_path):
    # accumulate=true on the first write changes nothing (buffers start at zero): dropping
    # it is an equivalent mutant, which the report lists with its diff
    path = tmp_path / "tied.module"
    path.write_text(TIED.format(first=", accumulate=true"), encoding="utf-8")
    out = tmp_path / "result.json"
    status = bm.main([str(path), "--kind", "drop-accumulate", "--jobs", "1", "--json", str(out)])
    result = json.loads(out.read_text())
    survivors = [m for m in result["mutants"] if m["verdict"] == "survived"]
    assert status == 1 and len(result["mutants"]) == 2 and len(survivors) == 1
    assert "-      (d_y, saved.h) -> matmul(transpose=TN, accumulate=true) -> d_w" \
        in survivors[0]["diff"]
    total = next(r for r in result["summary"] if r["file"] == "total" and r["kind"] == "all")
    assert (total["generated"], total["killed_types"], total["survived"]) == (2, 1, 1)


def test_branch_mutants_get_the_settings_that_take_the_branch():
    norm = bm.generate(ROOT / "std" / "modules" / "norm.module")
    settings = {m.settings.get("use_bias") for m in norm if m.declaration == "LayerNormParams"}
    assert settings == {"true", "false"}
