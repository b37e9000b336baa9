"""The `fuse` pass (modulec/lower/fusion.py, patterns in fusion_patterns.py): each pattern
fuses, barriers stop it, fused nodes keep their names and compute what the chain did.
The E013 reports of `@fuse` requests are UI tests (tests/ui/fusion/)."""

from __future__ import annotations

import textwrap
from collections import Counter
from pathlib import Path

import pytest

from modulec.cli.build_cmd import verify_document
from modulec.ir.serialize import dumps
from modulec.lower.build import BuildRequest, build
from modulec.lower.fusion import _View, match_at
from modulec.lower.fusion_patterns import BY_NAME, FUSION_ATTRS, PATTERNS
from modulec.paths import REPO_DIR

SHAPES = {"B": 2, "T": 4}
UI = Path(__file__).resolve().parent / "ui" / "fusion"


def built(tmp_path: Path, text: str):
    path = tmp_path / "t.module"
    path.write_text(textwrap.dedent(text))
    result = build(BuildRequest(path, shapes=SHAPES))
    assert result.document is not None, [d.message for d in result.diagnostics]
    return result


def forward(result):
    return result.graph.function(result.graph.entry)


def groups(function) -> Counter:
    return Counter(n.attr("fusion_group").split("@")[0] for n in function.nodes
                   if n.attr("fusion_group"))


RESIDUAL = """
    model Tiny(d: int = 8):
      params:
        w: [d, fp32]
      forward:
        in: (x: [B, T, d, fp32], r: [B, T, d, fp32])
        out: (y: [B, T, d, fp32], s: [B, T, d, fp32])
        graph:
          (r, x) -> add() -> s{note}
          (s, w) -> rmsnorm(eps=1e-5) -> (y, _)
    """


def test_residual_norm_fuses_automatically_and_keeps_names(tmp_path):
    result = built(tmp_path, RESIDUAL.format(note=""))
    (node,) = forward(result).nodes
    assert node.target == "fused_residual_rmsnorm" and node.id == "f0"
    assert node.attr("fused_from") == ["f0", "f1"] and node.attr("fusion") == "residual_norm"
    assert node.attr("fused_spans") == ["9:17", "10:17"] and node.attr("eps") == 1e-5
    (sum_,) = node.attr("fused_intermediates")
    assert forward(result).value(sum_).name == "s"  # the intermediate keeps its name
    assert node.inputs[:2] == ("r", "x") and node.outputs[0] == sum_  # `s` is still an output
    backward = result.graph.function(result.graph.backward)
    assert [n.target for n in backward.nodes] == ["fused_residual_rmsnorm_backward"]
    assert not set(dict(backward.nodes[0].attrs)) & set(FUSION_ATTRS)


@pytest.mark.parametrize("note", [" @nofuse", " @hook(AfterResidualAdd, mode=modify)",
                                  " @hook(AfterResidualAdd, mode=replace)"])
def test_nofuse_and_writing_hooks_are_barriers(tmp_path, note):
    targets = [n.target for n in forward(built(tmp_path, RESIDUAL.format(note=note))).nodes]
    assert targets == ["add", "rmsnorm"]


def test_an_observing_hook_is_no_barrier(tmp_path):
    result = built(tmp_path, RESIDUAL.format(note=" @hook(AfterResidualAdd)"))
    (node,) = forward(result).nodes
    assert node.target == "fused_residual_rmsnorm"
    assert ("hook", ("AfterResidualAdd",)) in node.annotations


def test_automatic_fusion_only_where_it_is_exact(tmp_path):
    """In bf16 the fused kernel normalizes the unrounded sum: not what the chain did."""
    text = RESIDUAL.format(note="").replace("fp32", "bf16")
    assert [n.target for n in forward(built(tmp_path, text)).nodes] == ["add", "rmsnorm"]


LAYERNORM = """
    model Tiny(d: int = 8):
      params:
        w: [d, fp32]
        b: [d, fp32]
      forward:
        in: (x: [B, T, d, fp32], r: [B, T, d, fp32])
        out: (y: [B, T, d, fp32], s: [B, T, d, fp32])
        graph:
          (r, x) -> add() -> s
          {norm}
    """


@pytest.mark.parametrize("bias", [True, False])
def test_residual_layernorm_fuses_automatically_in_fp32(tmp_path, bias):
    """add + layernorm -> fused_residual_layernorm (bias or none: the fused op's inputs
    stop at the weight); its backward is the fused primitive's; in bf16 it stays a chain."""
    norm = f"(s, w{', b' if bias else ''}) -> layernorm(eps=1e-5) -> (y, _, _)"
    result = built(tmp_path, LAYERNORM.format(norm=norm))
    (node,) = forward(result).nodes
    assert node.target == "fused_residual_layernorm" and node.attr("fusion") == "residual_layernorm"
    assert node.inputs == ("r", "x", "param:w") + (("param:b",) if bias else ())
    assert len(node.outputs) == 4 and node.attr("eps") == 1e-5
    backward = result.graph.function(result.graph.backward)
    assert [n.target for n in backward.nodes] == ["fused_residual_layernorm_backward"]
    low = built(tmp_path, LAYERNORM.format(norm=norm).replace("fp32", "bf16"))
    assert [n.target for n in forward(low).nodes] == ["add", "layernorm"]


def test_residual_layernorm_computes_what_the_chain_computed(tmp_path):
    torch = pytest.importorskip("torch")
    text = LAYERNORM.format(norm="(s, w, b) -> layernorm(eps=1e-5) -> (y, _, _)")
    fused = forward(built(tmp_path, text))
    unfused = forward(built(tmp_path, text.replace("add() -> s", "add() @nofuse -> s")))
    assert len(unfused.nodes) == 2 and len(fused.nodes) == 1
    g = torch.Generator().manual_seed(1)
    feed = {"x": torch.randn(2, 4, 8, generator=g), "r": torch.randn(2, 4, 8, generator=g),
            "param:w": torch.randn(8, generator=g), "param:b": torch.randn(8, generator=g)}
    want, got = _run(unfused, dict(feed)), _run(fused, dict(feed))
    for output in fused.outputs:
        assert torch.equal(want[output], got[output])


def test_every_requested_pattern_fuses():
    result = build(BuildRequest(UI / "fuse_requests_apply.module", shapes=SHAPES))
    assert result.document is not None
    # no errors; each group request (no kernel on any runtime yet) says so with W006
    assert {d.code for d in result.diagnostics} == {"W006"}
    assert len(result.diagnostics) == 6
    function = forward(result)
    targets = [n.target for n in function.nodes]
    assert targets.count("fused_residual_rmsnorm") == targets.count("fused_residual_layernorm") == 1
    assert groups(function) == {"bias_activation": 2, "linear_bias_act": 3, "norm_linear": 2,
                                "gated_mlp": 2, "attention_softmax": 2, "ops": 2}
    fused = {"residual_norm", "residual_layernorm"}
    assert {p.name for p in PATTERNS} <= set(groups(function)) | fused


FAN_OUT = """
    model Tiny(d: int = 8):
      params:
        bias: [d]
      forward:
        in: x: [B, T, d]
        out: (y: [B, T, d], z: [B, T, d])
        graph:
          (x, bias) -> add() -> s
          s -> gelu() -> y
          {extra}
    """


def test_fan_out_prevents_a_group(tmp_path):
    pattern = BY_NAME["bias_activation"]
    alone = forward(built(tmp_path, FAN_OUT.format(extra="y -> relu() -> z")))
    assert match_at(_View(alone, set()), pattern, 0)[0] is not None
    shared = forward(built(tmp_path, FAN_OUT.format(extra="s -> relu() -> z")))
    found, why = match_at(_View(shared, set()), pattern, 0)
    assert found is None and why == "the intermediate `s` is also read by `relu` (f2)"
    output = forward(built(tmp_path, FAN_OUT.format(extra="s -> z")))
    found, why = match_at(_View(output, set()), pattern, 0)
    assert found is None and "output of the function" in why


def test_fused_op_computes_what_the_chain_computed(tmp_path):
    """Run the forward function before and after the pass with the reference kernels."""
    torch = pytest.importorskip("torch")
    result = built(tmp_path, RESIDUAL.format(note=""))
    fused = forward(result)
    unfused = _unfused(tmp_path)
    assert len(unfused.nodes) == 2 and len(fused.nodes) == 1
    g = torch.Generator().manual_seed(0)
    feed = {"x": torch.randn(2, 4, 8, generator=g), "r": torch.randn(2, 4, 8, generator=g),
            "param:w": torch.randn(8, generator=g)}
    want, got = _run(unfused, dict(feed)), _run(fused, dict(feed))
    for output in fused.outputs:
        assert torch.equal(want[output], got[output])


def _unfused(tmp_path):
    """The same model with the chain kept (`@nofuse` changes nothing else)."""
    return forward(built(tmp_path, RESIDUAL.format(note=" @nofuse")))


def _run(function, values: dict) -> dict:
    from runtime.kernels import KERNELS

    for node in function.nodes:
        attrs = {k: v for k, v in node.attrs if k not in FUSION_ATTRS}
        outputs = KERNELS[node.target].forward([values[i] for i in node.inputs], attrs)
        values.update(zip(node.outputs, outputs))
    return values


@pytest.mark.parametrize("name", ["llama", "qwen3", "mistral", "mixtral"])
def test_std_models_build_verify_and_stay_deterministic(name, tmp_path):
    request = BuildRequest(REPO_DIR / "std" / "models" / f"{name}.module", shapes=SHAPES)
    first, second = build(request), build(request)
    assert first.document is not None and dumps(first.document) == dumps(second.document)
    path = tmp_path / f"{name}.ir"
    path.write_text(dumps(first.document))
    assert verify_document(path) == []


def test_fused_builds_are_byte_identical():
    request = BuildRequest(UI / "fuse_requests_apply.module", shapes=SHAPES)
    assert dumps(build(request).document) == dumps(build(request).document)
