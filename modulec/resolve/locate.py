"""Module paths -> files: search roots, folders, versioned files, declarations.

A dotted path is walked segment by segment inside one search root: folders, then a file
`<seg>.module` (or `<seg>.vN.module`), then an optional version segment `vN`, then an
optional declaration name. A root matches only when the whole path resolves there; the
first matching root wins. `locate` never reports diagnostics itself: it returns a `Target`
or the `Miss` that explains the failure (`modulec.resolve.messages` words it).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

SUFFIX = ".module"
VERSION = re.compile(r"v(\d+)\Z")
_FILE_NAME = re.compile(r"([A-Za-z_]\w*?)(?:\.v(\d+))?\.module\Z")

# Names a file declares (None when it cannot be parsed).
Declarations = Callable[[Path], "frozenset[str] | None"]


@dataclass(frozen=True)
class Root:
    """A search root: `path` is resolved; `prefix` is `("std",)` for the standard library."""

    path: Path
    label: str
    prefix: tuple[str, ...] = ()

    def describe(self) -> str:
        return f"{self.path} ({self.label})"


@dataclass(frozen=True)
class ModuleFile:
    """A `.module` file as a module: `std.modules.attention`, version 1 or None."""

    path: Path  # resolved: the cache key
    module_path: str
    version: int | None
    root: Root
    found_at: Path = field(default=Path(), compare=False)  # as listed (maybe a symlink)

    @property
    def inside_root(self) -> bool:
        """Import paths never escape their search root, symlinks included."""
        return self.path.is_relative_to(self.root.path)

    @property
    def version_name(self) -> str | None:
        return None if self.version is None else f"v{self.version}"


@dataclass(frozen=True)
class Target:
    """What a path names: one declaration (`name`), one file, or a folder of files."""

    kind: str  # "declaration" | "file" | "folder"
    files: tuple[ModuleFile, ...]
    name: str | None = None


@dataclass(frozen=True)
class Miss:
    """Why a path did not resolve in a root, at path segment `segment` (0-based)."""

    segment: int
    candidates: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    broken: tuple["ModuleFile", ...] = ()  # unparsable files that may hold the name
    conflict: tuple[Path, ...] = ()  # several files declare the name
    escape: Path | None = None  # a symlink leading outside the root

    @property
    def final(self) -> bool:
        """A refusal or a conflict ends the search: later roots are not tried."""
        return bool(self.conflict) or self.escape is not None


@dataclass
class Listing:
    """A folder's entries: module files by base name and version, and subfolders."""

    modules: dict[str, dict[int | None, Path]] = field(default_factory=dict)
    folders: set[str] = field(default_factory=set)
    # module files that are no symlink, resolved: the folder resolved once plus the name
    resolved: dict[Path, Path] = field(default_factory=dict)

    def latest(self, base: str) -> tuple[Path, int | None]:
        """The highest `vN` file, or the plain file when there is no versioned one."""
        versions = self.modules[base]
        numbered = [v for v in versions if v is not None]
        version = max(numbered) if numbered else None
        return versions[version], version


class Locator:
    """Resolves module paths; caches folder listings (files do not change during a run)."""

    def __init__(self, declarations: Declarations) -> None:
        self.declarations = declarations
        self._listings: dict[Path, Listing] = {}

    def locate(self, parts: tuple[str, ...], roots: list[Root]) -> Target | Miss:
        """The first root where the whole path resolves, else the deepest miss."""
        misses: list[Miss] = []
        for root in roots:
            found = self.walk(root, parts[len(root.prefix):])
            if isinstance(found, Target):
                return found
            found = _shift(found, len(root.prefix))
            if found.final:
                return found
            misses.append(found)
        return _deepest(misses)

    # ------------------------------------------------------------ inside one root
    def walk(self, root: Root, segments: tuple[str, ...]) -> Target | Miss:
        folder = root.path
        for index, segment in enumerate(segments):
            listing = self.listing(folder)
            if segment in listing.modules:
                return self.in_file(root, folder, segments, index)
            if segment in listing.folders:
                folder = folder / segment
                if not _inside(folder, root):
                    return Miss(index, escape=folder)
                continue
            if index == len(segments) - 1:
                return self.declaration_in_folder(root, folder, segments, index)
            return Miss(index, candidates=tuple(sorted(listing.modules.keys() | listing.folders)))
        return self.whole_folder(root, folder, segments)

    def in_file(self, root: Root, folder: Path, segments: tuple[str, ...],
                index: int) -> Target | Miss:
        listing = self.listing(folder)
        base, rest = segments[index], segments[index + 1:]
        if rest and VERSION.match(rest[0]):
            chosen = _exact_version(listing, base, int(rest[0][1:]), index + 1)
            rest = rest[1:]
        else:
            chosen = listing.latest(base)
        if isinstance(chosen, Miss):
            return chosen
        path, version = chosen
        module = _module(root, path, segments[:index + 1], version, listing)
        if not module.inside_root:
            return Miss(index, escape=path)
        return self.declaration_in_file(module, rest, len(segments) - len(rest))

    def declaration_in_file(self, module: ModuleFile, rest: tuple[str, ...],
                            index: int) -> Target | Miss:
        if not rest:
            return Target("file", (module,))
        names = self.declarations(module.path)
        if names is None:
            return Miss(index, broken=(module,))
        if rest[0] not in names:
            return Miss(index, candidates=tuple(sorted(names)))
        if len(rest) > 1:
            return Miss(index + 1, notes=(f"`{rest[0]}` is a declaration; it has no members",))
        return Target("declaration", (module,), rest[0])

    def declaration_in_folder(self, root: Root, folder: Path, segments: tuple[str, ...],
                              index: int) -> Target | Miss:
        name, hits, broken, known = segments[index], [], [], set()
        modules = self.folder_modules(root, folder, segments[:index])
        for module in (m for m in modules if m.inside_root):  # never read outside the root
            names = self.declarations(module.path)
            if names is None:
                broken.append(module)
            elif name in names:
                hits.append(module)
            known |= names or set()
        if len(hits) == 1:
            return Target("declaration", (hits[0],), name)
        if hits:
            return Miss(index, conflict=tuple(m.path for m in hits))
        escaping = [m.found_at for m in modules if not m.inside_root]
        if escaping:  # the name may be behind a link that leaves the root
            return Miss(index, escape=escaping[0])
        listing = self.listing(folder)
        candidates = known | listing.modules.keys() | listing.folders
        return Miss(index, candidates=tuple(sorted(candidates)), broken=tuple(broken))

    def whole_folder(self, root: Root, folder: Path, segments: tuple[str, ...]) -> Target | Miss:
        modules = self.folder_modules(root, folder, segments)
        for module in modules:
            if not module.inside_root:
                return Miss(max(len(segments) - 1, 0), escape=module.found_at)
        return Target("folder", tuple(modules))

    def folder_modules(self, root: Root, folder: Path,
                       segments: tuple[str, ...]) -> list[ModuleFile]:
        """The latest version of each module file directly in `folder`, by name."""
        listing = self.listing(folder)
        modules = []
        for base in sorted(listing.modules):
            path, version = listing.latest(base)
            modules.append(_module(root, path, segments + (base,), version, listing))
        return modules

    def listing(self, folder: Path) -> Listing:
        if folder not in self._listings:
            self._listings[folder] = _read_listing(folder)
        return self._listings[folder]


def split_file_name(name: str) -> tuple[str, int | None]:
    """`matmul.v2.module` -> ("matmul", 2); `llama.module` -> ("llama", None)."""
    match = _FILE_NAME.match(name)
    if match is None:
        return name.removesuffix(SUFFIX), None
    return match.group(1), int(match.group(2)) if match.group(2) else None


def _read_listing(folder: Path) -> Listing:
    listing = Listing()
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return listing
    real_folder = None
    for entry in entries:
        if entry.name.startswith("."):
            continue
        match = _FILE_NAME.match(entry.name)
        if match and entry.is_file():
            version = int(match.group(2)) if match.group(2) else None
            path = Path(entry.path)
            listing.modules.setdefault(match.group(1), {})[version] = path
            if not entry.is_symlink():
                real_folder = real_folder or Path(folder).resolve()
                listing.resolved[path] = real_folder / entry.name
        elif entry.is_dir():
            listing.folders.add(entry.name)
    return listing


def _exact_version(listing: Listing, base: str, number: int,
                   index: int) -> tuple[Path, int] | Miss:
    versions = listing.modules[base]
    if number in versions:
        return versions[number], number
    available = sorted(v for v in versions if v is not None)
    shown = ", ".join(f"v{v}" for v in available) or "none (only the unversioned file)"
    return Miss(index, candidates=tuple(f"v{v}" for v in available),
                notes=(f"available versions of `{base}`: {shown}",))


def _module(root: Root, path: Path, segments: tuple[str, ...], version: int | None,
            listing: Listing | None = None) -> ModuleFile:
    resolved = listing.resolved.get(path) if listing is not None else None
    return ModuleFile(resolved or path.resolve(), _dotted(root, segments), version, root, path)


def _inside(path: Path, root: Root) -> bool:
    """Import paths never escape their search root, symlinks included."""
    return path.resolve().is_relative_to(root.path)


def _dotted(root: Root, segments: tuple[str, ...]) -> str:
    return ".".join(root.prefix + segments)


def _shift(miss: Miss, offset: int) -> Miss:
    """A miss counted in root-relative segments, counted in the whole path's segments."""
    if not offset:
        return miss
    return Miss(miss.segment + offset, miss.candidates, miss.notes, miss.broken,
                miss.conflict, miss.escape)


def _deepest(misses: list[Miss]) -> Miss:
    """The miss that got furthest; candidates and notes of equally deep misses merged."""
    if not misses:
        return Miss(0)
    depth = max(m.segment for m in misses)
    deepest = [m for m in misses if m.segment == depth]
    candidates = sorted({c for m in deepest for c in m.candidates})
    notes = list(dict.fromkeys(n for m in deepest for n in m.notes))
    broken = tuple(p for m in deepest for p in m.broken)
    return Miss(depth, tuple(candidates), tuple(notes), broken)
