"""`modulec check --verify-backward`: the finite-difference check of runtime.verify, run
on every module, block and model of the files that check cleanly, and its report (a rich
table for people, one JSON object per gradient with `--format json`).

The runtime (torch) is imported only here, so plain `modulec check` stays fast."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

VERIFIABLE = ("module", "block", "model")


def verify_files(results, options: dict, fmt: str, color: bool) -> bool:
    """Verify every declaration with a forward in the files of `results` that checked
    without errors; print the report; True when every gradient passed."""
    try:
        from runtime.verify import VerifyOptions
    except ImportError as exc:
        click.echo(f"error: --verify-backward needs the runtime (torch): {exc}", err=True)
        return False
    verify = VerifyOptions(**options)
    rows, failures, params = [], [], set()
    for result in results:
        if result.ok and result.program is not None:
            for decl in _declarations(result.program):
                params |= {p.name for p in decl.params or ()}
                rows += _verify_one(Path(result.name), decl, verify, failures, fmt)
    skipped = sum(1 for r in results if not r.ok)
    _report(rows, failures, fmt, color, skipped)
    # a declaration that failed saw none of its dims: a `--set B=-3` was used, and failed
    used = _shapes_used(verify) & (bool(failures) or _settings_used(verify, params))
    return used and not failures and all(r.ok for r in rows)


def _shapes_used(verify) -> bool:
    """A `--shape` no verified declaration's inputs have sized nothing: say so."""
    unused = sorted(set(verify.shapes) - verify.seen_dims)
    for name in unused:
        dims = ", ".join(sorted(d for d in verify.seen_dims if d.isidentifier())) or "none"
        click.echo(f"error: --shape {name}={verify.shapes[name]}: no verified declaration's "
                   f"inputs have a dim `{name}` (their dims: {dims})", err=True)
    return not unused


def _settings_used(verify, params: set) -> bool:
    """A `--set` that names no verified declaration's parameter (nor a dim of their inputs,
    which a whole number sizes as --shape does) set nothing and said nothing: say so."""
    from runtime.verify_config import whole

    unused = sorted(n for n in set(verify.settings) - params
                    if n not in verify.seen_dims or not whole(verify.settings[n]))
    for name in unused:
        known = ", ".join(sorted(params)) or "none"
        why = f"`{name}` is a dim of the inputs: its size is a whole number" if name in \
            verify.seen_dims else f"no verified declaration has a parameter `{name}` (their " \
            f"parameters: {known})"
        click.echo(f"error: --set {name}={verify.settings[name]}: {why}", err=True)
    return not unused


def _declarations(program):
    return [d for d in program.decls if d.kind in VERIFIABLE and _has_forward(d)]


def _has_forward(decl) -> bool:
    from modulec.syntax import ast as A

    return any(isinstance(i, A.Section) and getattr(i.key, "id", "") == "forward"
               for i in decl.body)


def _verify_one(path: Path, decl, verify, failures: list, fmt: str) -> list:
    from runtime.errors import RuntimeUserError
    from runtime.verify import verify_declaration

    from modulec.cli.guard import CURRENT_FILE

    click.get_current_context().meta[CURRENT_FILE] = f"{path} ({decl.name})"
    if fmt != "json" and sys.stderr.isatty():
        click.echo(f"verifying {decl.name} ({path}) ...", err=True)
    try:
        return verify_declaration(path, decl, verify)
    except RuntimeUserError as exc:
        failures.append((decl.name, exc))
        return []


def _report(rows, failures, fmt: str, color: bool, skipped: int = 0) -> None:
    if fmt == "json":
        for row in rows:
            click.echo(json.dumps({"declaration": row.declaration, "backward": row.backward,
                                   "gradient": row.gradient, "max_rel_error": row.error,
                                   "ok": row.ok, "note": row.note}))
        for name, exc in failures:
            click.echo(json.dumps({"declaration": name, "ok": False, "error": exc.message,
                                   "help": exc.help}))
        return
    if rows:
        _table(rows, color)
    for name, exc in failures:
        click.echo(f"error: cannot verify `{name}`: {exc.message}", err=True)
        for line in exc.help:
            click.echo(f"  = help: {line}", err=True)
    click.echo(verdict_line(rows, failures, skipped))


def verdict_line(rows, failures, skipped: int) -> str:
    """`verified 12 gradients of 3 declarations: all gradients match`, or what failed,
    or why nothing was verified; files with check errors are never counted as verified."""
    bad = sum(1 for r in rows if not r.ok) + len(failures)
    not_run = f"; {_files(skipped)} with check errors not verified" if skipped else ""
    if not rows and not failures:
        reason = "every file has check errors" if skipped else \
            "no module, block or model with a forward"
        return f"verified no gradients: {reason}"
    verdict = f"{bad} failed" if bad else "all gradients match"
    return (f"verified {len(rows)} gradients of {len({r.declaration for r in rows})} "
            f"declarations: {verdict}{not_run}")


def _files(count: int) -> str:
    return f"{count} file" + ("" if count == 1 else "s")


def _table(rows, color: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table("declaration", "backward", "gradient", "max rel error", "verdict",
                  box=None, pad_edge=False)
    for row in rows:
        error = "-" if row.error is None else f"{row.error:.1e}"
        verdict = ("ok" if row.ok else "FAIL") + (f" ({row.note})" if row.note else "")
        style = None if row.ok else "bold red"
        table.add_row(row.declaration, row.backward, row.gradient, error, verdict, style=style)
    Console(no_color=not color, highlight=False, width=120).print(table)
