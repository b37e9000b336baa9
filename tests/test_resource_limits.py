"""Huge and nonsensical sizes fail fast with a diagnostic naming the limit and the value,
never with exit 101 or after eating memory (issue 16 item 3): a billion layers, a 10^12
model width, a 10^15 sequence, a 5,000-digit setting."""

from __future__ import annotations

import pytest

from tests.test_cli import run

LLAMA = "std/models/llama.module"


@pytest.mark.parametrize("args,status,message", [
    (["--set", "n_layers=1000000000"], 1,
     "an array of blocks' size must be at most 10,000: this is 1,000,000,000"),
    (["--set", "d_model=1000000000000"], 1, "the most a tensor may hold is 1,099,511,627,776"),
    (["--shape", "T=1000000000000000"], 2, "a size is from 1 to 1,099,511,627,776"),
    (["--set", "d_model=" + "9" * 5000], 1, "(5000 characters)`: not an expression (this integer literal has 5,000 digits)"),
    (["--shape", "T=" + "9" * 5000], 2, "the size must be an integer"),
])
def test_huge_sizes_are_diagnostics(args, status, message, tmp_path):
    result = run("build", LLAMA, "--shape", "B=1", *(["--shape", "T=8"] if "T=" not in
                                                      args[1] else []), *args,
                 "-o", tmp_path / "x.ir")
    assert result.exit_code == status, result.output
    assert message in result.output
