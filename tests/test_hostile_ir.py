"""The hostile-IR corpus (issue 16): every kind of damage in tests/hostile_ir.py is refused
by `modulec ir verify` (error lines, exit status 1, never a traceback or exit 101) and by
the runtime loader of `modulec run x.ir` (exit 1, no tensor made, nothing written)."""

from __future__ import annotations

import pytest

from modulec.lower.build import BuildRequest, build
from modulec.paths import REPO_DIR
from modulec.plan.distributed import DataParallel
from tests.hostile_ir import DP, PLAIN, RAW, SHAPES, TINY, hostile_cases, text
from tests.test_cli import run

KINDS = [kind for kind, *_ in RAW + PLAIN + DP]


def _built(**options) -> dict:
    result = build(BuildRequest(REPO_DIR / "std/models/llama.module", shapes=SHAPES,
                                settings={k: str(v) for k, v in TINY.items()}, **options))
    assert result.document is not None, [d.message for d in result.diagnostics]
    return result.document


@pytest.fixture(scope="module")
def corpus() -> dict:
    cases = hostile_cases(_built(), _built(distributed=DataParallel(2, 3)))
    return {kind: (document, expected) for kind, document, expected in cases}


def test_the_corpus_has_sixty_kinds_of_damage(corpus):
    assert len(KINDS) == len(set(KINDS)) == len(corpus) >= 60


def test_the_undamaged_documents_verify(tmp_path):
    for document in (_built(), _built(distributed=DataParallel(2, 3))):
        path = tmp_path / "good.ir"
        path.write_text(text(document))
        result = run("ir", "verify", path)
        assert result.exit_code == 0, result.output


@pytest.mark.parametrize("kind", KINDS)
def test_ir_verify_refuses(corpus, kind, tmp_path):
    document, expected = corpus[kind]
    path = tmp_path / "hostile.ir"
    path.write_text(text(document))
    result = run("ir", "verify", path)
    assert result.exit_code == 1, (kind, result.output)
    assert "Traceback" not in result.output and "bug in modulec" not in result.output
    assert result.stderr.startswith("error: ") and expected in result.stderr, result.stderr


@pytest.fixture
def no_tensors(monkeypatch):
    """Records any parameter or forward the runtime would make from a refused document."""
    from runtime.model import Model

    made = []
    monkeypatch.setattr(Model, "init_random", lambda self, *a, **k: made.append("init"))
    monkeypatch.setattr(Model, "forward", lambda self, **k: made.append("forward"))
    return made


@pytest.mark.parametrize("kind", KINDS)
def test_run_refuses_before_making_a_tensor(corpus, kind, tmp_path, no_tensors):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    document, _ = corpus[kind]
    path, inputs, out = (tmp_path / n for n in ("hostile.ir", "in.safetensors",
                                                 "out.safetensors"))
    path.write_text(text(document))
    save_file({"token_ids": torch.zeros(SHAPES["B"], SHAPES["T"], dtype=torch.int32)},
              str(inputs))
    result = run("run", path, "--random-weights", "0", "--inputs", inputs, "--outputs", out)
    assert result.exit_code == 1, (kind, result.output)
    assert "Traceback" not in result.output and "bug in modulec" not in result.output
    assert "invalid IR" in result.output or "cannot read IR" in result.output, result.output
    assert no_tensors == [] and not out.exists()
