"""Import resolution: module paths -> files -> declarations, and each file's names.

    resolver = Resolver(search_path=[Path("lib")])     # std_root defaults to the bundled std/
    file = resolver.load("model.module")               # follows imports transitively
    file.diagnostics                                   # syntax + resolution diagnostics
    binding = file.scope.lookup("GQA", span)           # -> Binding | None
    binding = file.scope.lookup_qualified(("M", "Linear"), span)
    resolver.files()                                   # every file loaded (for module.lock)
    resolver.primitives()                              # the prelude: name -> Binding

Lookups report an E023 ambiguity into `scope.diagnostics` (the file's diagnostics list) and
return None. `scope.unresolved_import(parts)` tells later passes that a missing name may
come from an import that failed and was already reported. Rules: docs/decisions.md,
"Imports (issue 3)".
"""

from modulec.resolve.resolver import ResolvedFile, Resolver
from modulec.resolve.scope import Binding, Scope

__all__ = ["Binding", "ResolvedFile", "Resolver", "Scope"]
