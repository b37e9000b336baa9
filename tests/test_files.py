"""modulec.files: the one atomic file writer (the compiler's IR, module.lock, formatted
sources and pictures; the runtime's config.json, index, checkpoint files and token files).
Torch-free, as the compiler is."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from modulec import files


@pytest.mark.parametrize("failing", ["write", "chmod", "fsync", "replace"])
def test_atomic_write_replaces_whole_or_leaves_the_old_file(tmp_path, monkeypatch, failing):
    """While the new bytes are written the old file is still whole under its name; done,
    the new file is there with the umask's permissions; a failure at any step (the write,
    or os.chmod / os.fsync / os.replace) leaves the old file and no temp file."""
    target = tmp_path / "config.json"

    def writer(fail: bool):
        def write(tmp):
            assert Path(tmp).parent == tmp_path and target.read_text() == "old"
            Path(tmp).write_text("new half")
            if fail:
                raise OSError("write failed")
            Path(tmp).write_text("new")
        return write

    target.write_text("old")
    files.atomic_write(target, writer(fail=False))
    assert target.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == [target.name]
    assert target.stat().st_mode & 0o777 == 0o666 & ~files.current_umask()

    def broken(*args, **kwargs):
        raise OSError(f"{failing} failed")

    target.write_text("old")
    if failing != "write":
        monkeypatch.setattr(os, failing, broken)
    with pytest.raises(OSError, match=f"{failing} failed"):
        files.atomic_write(target, writer(fail=failing == "write"))
    monkeypatch.undo()
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == [target.name]


def test_atomic_text_writes_utf8_with_newline_line_ends(tmp_path):
    """The same bytes on every platform: a module.lock or IR file does not change with
    the machine that wrote it."""
    target = tmp_path / "module.lock"
    files.atomic_text(target, "a: é\nb\n")
    assert target.read_bytes() == "a: é\nb\n".encode("utf-8")


def test_a_lock_that_cannot_be_written_is_the_users_error(tmp_path, monkeypatch):
    """`modulec lock` into a folder it cannot write to: a one-line error naming the file
    (exit 1, no internal compiler error), the old module.lock whole, no temp file."""
    from click.testing import CliRunner

    from modulec.cli.main import modulec

    (tmp_path / "main.module").write_text("")
    (tmp_path / "module.lock").write_text("old")

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "replace", refused)
    result = CliRunner().invoke(modulec, ["lock", str(tmp_path / "main.module")])
    assert result.exit_code == 1, result.output
    assert "module.lock" in result.output and "Permission denied" in result.output
    assert "internal compiler error" not in result.output
    assert (tmp_path / "module.lock").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["main.module", "module.lock"]
