"""The standard library checks clean, and each std model instantiates without diagnostics at
its defaults and at the sizes of real published checkpoints of its family."""

import pytest
from click.testing import CliRunner

from modulec.check.driver import check_instance, scopes_of
from modulec.cli.main import modulec
from modulec.paths import REPO_DIR, data_dir
from modulec.resolve import Resolver
from modulec.types.dims import Dim

CHECKPOINTS = {
    # (file, model): {checkpoint name: config}
    ("llama", "Llama"): {
        "Llama-2-7B": {},
        "Llama-2-70B": dict(d_model=8192, n_layers=80, num_heads=64, num_kv_heads=8, d_ff=28672),
        "Llama-3-8B": dict(vocab_size=128256, num_kv_heads=8, d_ff=14336, max_seq=8192,
                           rope_theta=500000.0),
        "TinyLlama-1.1B": dict(d_model=2048, n_layers=22, num_kv_heads=4, d_ff=5632, max_seq=2048),
    },
    ("qwen3", "Qwen3"): {
        "Qwen3-8B": {},
        "Qwen3-0.6B": dict(d_model=1024, n_layers=28, num_heads=16, num_kv_heads=8, d_ff=3072,
                           tie_word_embeddings=True),
        "Qwen3-32B": dict(d_model=5120, n_layers=64, num_heads=64, num_kv_heads=8, d_ff=25600),
    },
    ("qwen2", "Qwen2"): {
        "Qwen2.5-7B": {},
        "Qwen2.5-0.5B": dict(vocab_size=151936, d_model=896, n_layers=24, num_heads=14,
                             num_kv_heads=2, d_ff=4864, max_seq=32768, tie_word_embeddings=True),
    },
    ("gemma", "Gemma"): {
        "Gemma-7B": {},
        "Gemma-2B": dict(d_model=2048, n_layers=18, num_heads=8, num_kv_heads=1, d_ff=16384),
    },
    ("gpt2", "GPT2"): {
        "GPT-2": {},
        "GPT-2-XL": dict(d_model=1600, n_layers=48, num_heads=25),
    },
    ("mistral", "Mistral"): {
        "Mistral-7B-v0.1": {},
        "Mistral-Nemo-12B": dict(vocab_size=131072, d_model=5120, n_layers=40, num_kv_heads=8,
                                 head_dim=128, d_ff=14336, window_size=None, rope_theta=1000000.0),
    },
    ("mixtral", "Mixtral"): {
        "Mixtral-8x7B": {},
        "Mixtral-8x22B": dict(vocab_size=32768, d_model=6144, n_layers=56, num_heads=48,
                              num_kv_heads=8, d_ff=16384, max_seq=65536),
    },
}


def values(config: dict) -> dict:
    return {k: Dim.const(v) if isinstance(v, int) and not isinstance(v, bool) else v
            for k, v in config.items()}


def model(resolver, file: str, name: str):
    loaded = resolver.load(data_dir("std") / "models" / f"{file}.module")
    assert not loaded.diagnostics
    (decl,) = [d for d in loaded.program.decls if d.name == name]
    return decl, loaded.scope


@pytest.fixture(scope="module")
def resolver():
    return Resolver()


def test_std_and_examples_check_clean():
    result = CliRunner().invoke(modulec, ["check", "--format", "json", str(REPO_DIR / "std"),
                                          str(REPO_DIR / "examples")])
    assert result.exit_code == 0, result.output
    assert result.output == ""


CASES = [(file, name, checkpoint, config) for (file, name), table in CHECKPOINTS.items()
         for checkpoint, config in table.items()]


@pytest.mark.parametrize("file, name, checkpoint, config", CASES, ids=[c[2] for c in CASES])
def test_model_instantiates_at_real_sizes(resolver, file, name, checkpoint, config):
    decl, scope = model(resolver, file, name)
    diagnostics = check_instance(decl, scope, values(config), scopes_of(resolver))
    assert [d.message for d in diagnostics] == []


def test_inconsistent_sizes_are_reported(resolver):
    decl, scope = model(resolver, "llama", "Llama")
    diagnostics = check_instance(decl, scope, values(dict(num_heads=30)), scopes_of(resolver))
    assert diagnostics and {d.code for d in diagnostics} <= {"E027", "E004"}
    assert any("divisible" in d.message for d in diagnostics)


def test_every_parameter_of_every_model_resolves(resolver):
    """A `Broken` parameter is silent by design (its error is reported once, elsewhere), so
    check that none hides in a model tree: every submodule resolved in its own file."""
    from modulec.check.instance import Broken, Stack, Submodule, instantiate
    from modulec.check.world import World

    def walk(instance, path):
        for name, value in instance.params.items():
            assert not isinstance(value, Broken), f"{path}.{name} did not resolve"
            if isinstance(value, (Submodule, Stack)):
                yield from walk(value.instance, f"{path}.{name}")
        yield path

    for file, name in CHECKPOINTS:
        decl, scope = model(resolver, file, name)
        world = World(scope, scopes_of(resolver))
        paths = list(walk(instantiate(world, world.definition(decl)), name))
        assert len(paths) >= 6  # model, blocks, norms, attention, mlp/experts
