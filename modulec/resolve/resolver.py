"""`Resolver`: loads files, follows their imports (transitively) and builds their scopes."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from modulec.diagnostics import Diagnostic, error
from modulec.paths import data_dir
from modulec.resolve import messages
from modulec.resolve.imports import Request, ScopeBuilder, requests, segment_span
from modulec.lazymap import LazyMapping
from modulec.resolve.locate import Locator, Miss, ModuleFile, Root, Target, split_file_name
from modulec.resolve.scope import Binding, Scope
from modulec.source import SourceFile
from modulec.syntax import ast as A

MODULEPATH = "MODULEPATH"


@dataclass
class Parsed:
    """A file read and parsed once: `ok` when it has no errors (imports may use it)."""

    source: SourceFile | None
    program: A.Program | None
    diagnostics: list[Diagnostic]

    @property
    def ok(self) -> bool:
        return self.program is not None and not any(d.is_error for d in self.diagnostics)


@dataclass
class ResolvedFile:
    """One loaded file: its tree, its names, and its syntax and resolution diagnostics."""

    path: Path  # resolved
    module_path: str  # `std.modules.attention`; a file loaded directly: its stem
    version: str | None
    source: SourceFile | None
    program: A.Program | None
    scope: Scope
    diagnostics: list[Diagnostic]
    dependencies: list[ModuleFile] = field(default_factory=list)  # files it imports

    @property
    def ok(self) -> bool:
        return not any(d.is_error for d in self.diagnostics)


class Resolver:
    """Resolves imports. Search roots: the standard library (for `std.` paths only), then
    the importing file's folder, then `search_path` in order, then `$MODULEPATH`."""

    def __init__(self, search_path: list[Path] | tuple[Path, ...] = (),
                 std_root: Path | None = None) -> None:
        self.std_root = Path(std_root or data_dir("std")).resolve()
        env = [p for p in os.environ.get(MODULEPATH, "").split(os.pathsep) if p]
        self.extra_roots = [Root(Path(p).resolve(), "--path") for p in search_path] + \
                           [Root(Path(p).resolve(), MODULEPATH) for p in env]
        self.locator = Locator(self._declarations)
        self._parsed: dict[Path, Parsed] = {}
        self._files: dict[Path, ResolvedFile] = {}
        self._loading: list[Path] = []
        self._cycles: list[list[Path]] = []  # import chains found closed, a -> b -> a
        self._prelude: dict[str, Binding] | None = None

    # ------------------------------------------------------------ public
    def load(self, path: Path | str) -> ResolvedFile:
        """Load a file and, transitively, everything it imports (each file once)."""
        resolved = Path(path).resolve()
        self._parse(resolved, shown=str(path))
        return self._load(resolved, None)

    def files(self) -> list[ResolvedFile]:
        """Every file loaded so far, in the order loading started."""
        return list(self._files.values())

    def primitives(self) -> dict[str, Binding]:
        """The prelude: every declaration of `<std>/primitives/`, always in scope."""
        if self._prelude is None:
            folder = self.std_root / "primitives"
            root = Root(self.std_root, "standard library", ("std",))
            modules = self.locator.folder_modules(root, folder, ("primitives",))
            by_name = {m.path.name.split(".")[0]: m for m in modules}
            self._prelude = LazyMapping(by_name, lambda name: self._prelude_file(by_name[name]))
        return self._prelude

    def _prelude_file(self, module) -> dict[str, Binding]:
        """The bindings of one primitives file, read when one of its names is first used."""
        if not self._parse(module.path).ok:
            return {}
        return {b.name: b for b in self._bindings(module, "prelude")}

    def roots(self, parts: tuple[str, ...], importing: Path) -> list[Root]:
        """Where `parts` is looked up from a file in `importing`'s folder."""
        if parts[0] == "std":
            return [Root(self.std_root, "standard library", ("std",))]
        return [Root(importing.parent, "the importing file's folder"), *self.extra_roots]

    # ------------------------------------------------------------ one file
    def _load(self, path: Path, module: ModuleFile | None) -> ResolvedFile:
        """The file's ResolvedFile; registered before its imports are followed, so a file
        reached again while it loads (a cycle) is returned as it stands."""
        if path in self._files:
            return self._files[path]
        module_path, version = (module.module_path, module.version_name) if module \
            else self._module_name(path)
        parsed = self._parse(path)
        diagnostics = list(parsed.diagnostics)
        resolved = ResolvedFile(path, module_path, version, parsed.source, parsed.program,
                                Scope(diagnostics, self.primitives()), diagnostics)
        self._files[path] = resolved
        if parsed.program is not None:
            local = ModuleFile(path, module_path, _version_number(version), Root(path.parent, ""))
            resolved.scope.locals = {b.name: b for b in reversed(self._bindings(local, "local"))}
            self._loading.append(path)
            try:
                self._add_imports(resolved, ScopeBuilder(resolved.scope, diagnostics))
            finally:
                self._loading.pop()
        return resolved

    def _add_imports(self, resolved: ResolvedFile, builder: ScopeBuilder) -> None:
        found, problems = requests(resolved.program, resolved.source)
        resolved.diagnostics.extend(problems)
        failed_statements: set[int] = set()
        for request in found:
            target = self._target(resolved, request, failed_statements)
            if target is None:
                builder.mark_failed(request)
            else:
                self._bind(resolved, request, target, builder)
        builder.finish(self.std_root / "primitives", resolved.path)

    def _bind(self, resolved: ResolvedFile, request: Request, target: Target,
              builder: ScopeBuilder) -> None:
        usable = self._follow(resolved, request, target)
        if len(usable) < len(target.files):  # a file did not parse: its errors say why
            builder.mark_failed(request)
        if target.files and not usable:
            return
        bindings = [b for m in usable for b in self._bindings(m, "import")
                    if target.name in (None, b.name)]
        module = usable[0].module_path if target.kind == "declaration" else \
            ".".join(request.parts)
        builder.add(request, target.kind, bindings, module)

    def _load_reporting_cycles(self, resolved: ResolvedFile, request: Request,
                               module: ModuleFile) -> None:
        """Load an imported file; a cycle it closes back to this file is reported here too,
        so that checking either file alone shows it."""
        known = len(self._cycles)
        self._load(module.path, module)
        for chain in self._cycles[known:]:
            if _has_edge(chain, resolved.path, module.path):  # every file on the loop
                rotated = _starting_at(chain, resolved.path)
                resolved.diagnostics.append(messages.circular(request.span, rotated))

    def _target(self, resolved: ResolvedFile, request: Request,
                failed_statements: set[int]) -> Target | None:
        """Locate the request's path; report why not (once per statement path)."""
        roots = self.roots(request.parts, resolved.path)
        found = self.locator.locate(request.parts, roots)
        if isinstance(found, Target):
            return found
        if found.broken:  # their own syntax errors say it all
            for broken in found.broken:
                self._load(broken.path, broken)
            return None
        if found.segment < request.base:
            if id(request.statement) in failed_statements:
                return None
            failed_statements.add(id(request.statement))
        span = segment_span(resolved.source, request, found.segment)
        resolved.diagnostics.append(self._miss_diagnostic(request, found, span, roots))
        return None

    def _miss_diagnostic(self, request: Request, miss: Miss, span, roots) -> Diagnostic:
        if miss.conflict:
            dotted = ".".join(request.parts[:miss.segment + 1])
            return messages.declared_twice(dotted, request.parts[miss.segment], miss.conflict,
                                           span)
        shown = request.parts if miss.segment >= request.base else request.parts[:request.base]
        return messages.cannot_find(shown, miss, span, roots, self._std_hint(request.parts))

    def _std_hint(self, parts: tuple[str, ...]) -> str | None:
        """`std.<parts>` when that exists: the user probably forgot the `std.`."""
        if parts[0] == "std":
            return None
        std_parts = ("std",) + parts
        found = self.locator.locate(std_parts, self.roots(std_parts, Path()))
        return ".".join(std_parts) if isinstance(found, Target) else None

    def _follow(self, resolved: ResolvedFile, request: Request,
                target: Target) -> list[ModuleFile]:
        """Load the target's files (E007 on a cycle); those that parsed can be used."""
        usable = []
        for module in target.files:
            resolved.dependencies.append(module)
            if module.path in self._loading:
                chain = self._loading[self._loading.index(module.path):] + [module.path]
                self._cycles.append(chain)
                told = _starting_at(chain, resolved.path)
                resolved.diagnostics.append(messages.circular(request.span, told))
            else:
                self._load_reporting_cycles(resolved, request, module)
            if self._parse(module.path).ok:
                usable.append(module)
        return usable

    # ------------------------------------------------------------ files and names
    def _parse(self, path: Path, shown: str | None = None) -> Parsed:
        """Parse once; diagnostics name the file as given, or relative to the working folder."""
        if path not in self._parsed:
            in_std = path.is_relative_to(self.std_root)  # shipped, stable: cached trees
            self._parsed[path] = _read_and_parse(path, shown or _display_name(path), in_std)
        return self._parsed[path]

    def _declarations(self, path: Path) -> frozenset[str] | None:
        parsed = self._parse(path)
        return frozenset(d.name for d in parsed.program.decls) if parsed.ok else None

    def _bindings(self, module: ModuleFile, origin: str) -> list[Binding]:
        program = self._parse(module.path).program
        decls = program.decls if program is not None else []
        return [Binding(d.name, d, module.path, module.module_path, module.version_name,
                        d.kind, origin) for d in decls]

    def _module_name(self, path: Path) -> tuple[str, str | None]:
        """`std.modules.attention` for a file of the standard library, else the file's stem."""
        base, version = split_file_name(path.name)
        version_name = None if version is None else f"v{version}"
        if path.is_relative_to(self.std_root):
            folders = path.parent.relative_to(self.std_root).parts
            return ".".join(("std", *folders, base)), version_name
        return base, version_name


def _read_and_parse(path: Path, shown: str, cache: bool = False) -> Parsed:
    from modulec.syntax.parser import parse_source

    try:
        source = SourceFile(shown, path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        reason = f"not valid UTF-8 (byte offset {exc.start})" \
            if isinstance(exc, UnicodeDecodeError) else (exc.strerror or str(exc))
        return Parsed(None, None, [error("", f"cannot read {shown}: {reason}", None)])
    result = parse_source(source, cache)
    return Parsed(source, result.program, list(result.diagnostics))


def _display_name(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except (ValueError, OSError):
        return str(path)


def _version_number(version: str | None) -> int | None:
    return None if version is None else int(version[1:])


def _has_edge(chain: list[Path], source: Path, target: Path) -> bool:
    """Whether the import loop `chain` (a -> b -> c -> a) goes from `source` to `target`."""
    return any(a == source and b == target for a, b in zip(chain, chain[1:]))


def _starting_at(chain: list[Path], path: Path) -> list[Path]:
    """The loop told from `path`: a -> b -> c -> a seen from b is b -> c -> a -> b."""
    loop = chain[:-1]
    start = loop.index(path)
    return loop[start:] + loop[:start] + [path]
