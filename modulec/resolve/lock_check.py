"""`module.lock` read back: `check` and `build` compare it with what the imports resolve to.

The lock next to a file (written by `modulec lock FILE`) pins each module the file imports,
directly or not, to a version and a hash. When the file's imports now resolve to something
else (a module edited since, another version, an import the lock lacks), W007 says which
module and how, with the command that updates the lock. Modules the lock lists but the
file does not import are not reported: they may be another file's (one lock per folder).
"""

from __future__ import annotations

from modulec.diagnostics import Diagnostic, warning
from modulec.resolve.lockfile import LOCK_NAME, lock_text

CODE = "W007"


def lock_problems(resolver, entry, shown: str) -> list[Diagnostic]:
    """W007s for `entry` (a ResolvedFile loaded by `resolver`, named `shown` on the command
    line) against its folder's lock; none when there is no lock or the imports did not
    resolve."""
    lock = entry.path.parent / LOCK_NAME
    if not lock.is_file() or not all(loaded.ok for loaded in resolver.files()):
        return []
    try:
        locked = parse_lock(lock.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError):
        return []
    text, conflicts = lock_text(resolver, entry)
    if conflicts:
        return []
    resolved = parse_lock(text)
    command = " ".join(["modulec lock", *(f"--path {root.path}" for root in
                                          getattr(resolver, "extra_roots", ())
                                          if root.label == "--path"), shown])
    return [_stale(command, key, locked.get(key), value)
            for key, value in sorted(resolved.items()) if locked.get(key) != value]


def parse_lock(text: str) -> dict[str, str]:
    """Module key -> `std@v1 sha256:...` / `local@...`, from a lock's text."""
    entries: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("  ") and ":" in line:
            key, value = line.strip().split(":", 1)
            entries[key.strip()] = value.strip()
    return entries


def _stale(command: str, key: str, locked: str | None, now: str) -> Diagnostic:
    if locked is None:
        message = f"`{LOCK_NAME}` is out of date: `{key}` is imported but not locked"
    else:
        message = f"`{LOCK_NAME}` is out of date: `{key}` is locked as `{locked}` but " \
                  f"resolves to `{now}`"
    return warning(CODE, message, None,
                   help=[f"run `{command}` to lock what the imports resolve to now, or "
                         "restore the locked module"])
