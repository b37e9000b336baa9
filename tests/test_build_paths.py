"""Issue 16 item 10: the bytes of `modulec build -o` do not depend on the working
directory, and `modulec check DIR` reads nothing outside DIR."""

from __future__ import annotations

import os

from tests.test_cli import run, write

TINY = """\
model Tiny(vocab: int = 16, d: int = 8):
  params:
    embedding: [vocab, d]
    proj: [d, d]
  forward:
    in: token_ids: [B, T, int32]
    out: y: [B, T, d]
    graph:
      (token_ids, embedding) -> embedding() -> h
      h -> matmul(proj, transpose=NT) -> y
"""


def _build(cwd, file, out, monkeypatch) -> bytes:
    monkeypatch.chdir(cwd)
    result = run("build", file, "--shape", "B=1", "--shape", "T=4", "-o", out)
    assert result.exit_code == 0, result.output
    return out.read_bytes()


def test_builds_are_byte_identical_from_any_working_directory(tmp_path, monkeypatch):
    source = write(tmp_path / "proj", "tiny.module", TINY)
    here = os.getcwd()
    from_parent = _build(tmp_path, "proj/tiny.module", tmp_path / "a.ir", monkeypatch)
    from_folder = _build(tmp_path / "proj", "tiny.module", tmp_path / "b.ir", monkeypatch)
    absolute = _build(here, source, tmp_path / "c.ir", monkeypatch)
    assert from_parent == from_folder == absolute
    text = from_parent.decode()
    assert '"tiny.module"' in text and str(tmp_path) not in text and "proj/" not in text


def test_check_does_not_follow_links_out_of_the_folder(tmp_path):
    secret = tmp_path / "outside.txt"
    secret.write_text("TOP-SECRET first line\n", encoding="utf-8")
    folder = tmp_path / "models"
    write(folder, "ok.module", TINY)
    (folder / "leak.module").symlink_to(secret)
    (folder / "same.module").symlink_to(folder / "ok.module")  # inside: still checked once
    result = run("check", folder)
    assert "TOP-SECRET" not in result.output and "leak.module" not in result.output
    assert result.exit_code == 0, result.output


def test_an_output_folder_that_does_not_exist_is_a_usage_error(tmp_path):
    source = write(tmp_path, "tiny.module", TINY)
    result = run("build", source, "--shape", "B=1", "--shape", "T=4",
                 "-o", tmp_path / "missing" / "tiny.ir")
    assert result.exit_code == 2, result.output
    assert "folder" in result.output and "does not exist" in result.output
    assert "internal compiler error" not in result.output


def test_a_write_that_fails_is_the_users_error_and_leaves_nothing(tmp_path):
    import click
    import pytest

    from modulec.cli.build_cmd import write_output

    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(click.FileError) as failure:
        write_output(blocker / "x.ir", "{}")
    assert "x.ir" in failure.value.format_message()
    assert [p.name for p in tmp_path.iterdir()] == ["file"]  # no temporary file left
