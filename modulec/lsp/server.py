"""The pygls server: documents are checked on open, change and save (the unsaved text of
every open document is what imports see); hover and definition use the last check."""

from __future__ import annotations

import sys
from pathlib import Path

from lsprotocol import types as T
from pygls.lsp.server import LanguageServer
from pygls.uris import to_fs_path

from modulec import __version__
from modulec.lsp.analysis import Analysis, analyze
from modulec.lsp.convert import START, to_lsp, to_range
from modulec.lsp.navigate import definition, hover


class ModulecServer(LanguageServer):
    shut_down = False  # `exit` before `shutdown` ends the process with status 1 (LSP)


def build_server(search_path=()) -> ModulecServer:
    server = ModulecServer("modulec", __version__,
                           text_document_sync_kind=T.TextDocumentSyncKind.Incremental)
    analyses: dict[str, Analysis] = {}

    def path_of(uri: str) -> Path:
        return Path(to_fs_path(uri) or Path.cwd() / uri.rpartition("/")[2]).resolve()

    def refresh(uri: str) -> None:
        doc = server.workspace.get_text_document(uri)
        overlay = {path_of(d.uri): d.source for d in server.workspace.text_documents.values()}
        path = path_of(uri)
        try:
            analysis = analyze(path, doc.source, overlay, search_path)
        except Exception as exc:  # noqa: BLE001 - a compiler bug must not stop the server
            analyses.pop(uri, None)
            publish(uri, doc.version, [internal_error(exc)])
            return
        analyses[uri] = analysis
        codec, lines = server.workspace.position_codec, doc.lines
        found = [to_lsp(d, str(path), uri) for d in analysis.diagnostics]
        for item in found:
            item.range = codec.range_to_client_units(lines, item.range)
        publish(uri, doc.version, found)

    def publish(uri: str, version, diagnostics: list[T.Diagnostic]) -> None:
        server.text_document_publish_diagnostics(
            T.PublishDiagnosticsParams(uri=uri, diagnostics=diagnostics, version=version))

    def position(uri: str, pos: T.Position) -> tuple[Analysis | None, int, int]:
        doc = server.workspace.get_text_document(uri)
        pos = server.workspace.position_codec.position_from_client_units(doc.lines, pos)
        return analyses.get(uri), pos.line + 1, pos.character + 1

    @server.feature(T.TEXT_DOCUMENT_DID_OPEN)
    def did_open(ls, params: T.DidOpenTextDocumentParams) -> None:
        refresh(params.text_document.uri)

    @server.feature(T.TEXT_DOCUMENT_DID_CHANGE)
    def did_change(ls, params: T.DidChangeTextDocumentParams) -> None:
        refresh(params.text_document.uri)

    @server.feature(T.TEXT_DOCUMENT_DID_SAVE)
    def did_save(ls, params: T.DidSaveTextDocumentParams) -> None:
        for uri in list(analyses):  # a saved file may change what the others import
            refresh(uri)

    @server.feature(T.TEXT_DOCUMENT_DID_CLOSE)
    def did_close(ls, params: T.DidCloseTextDocumentParams) -> None:
        analyses.pop(params.text_document.uri, None)
        publish(params.text_document.uri, None, [])

    @server.feature(T.SHUTDOWN)
    def on_shutdown(ls, params) -> None:
        ls.shut_down = True

    @server.feature(T.TEXT_DOCUMENT_HOVER)
    def on_hover(ls, params: T.HoverParams) -> T.Hover | None:
        analysis, line, column = position(params.text_document.uri, params.position)
        text = hover(analysis, line, column) if analysis is not None else None
        return T.Hover(T.MarkupContent(T.MarkupKind.Markdown, text)) if text else None

    @server.feature(T.TEXT_DOCUMENT_DEFINITION)
    def on_definition(ls, params: T.DefinitionParams) -> list[T.Location] | None:
        analysis, line, column = position(params.text_document.uri, params.position)
        if analysis is None:
            return None
        doc = server.workspace.get_text_document(params.text_document.uri)
        codec = server.workspace.position_codec
        return [T.Location(params.text_document.uri,
                           codec.range_to_client_units(doc.lines, to_range(span)))
                if path == analysis.path else T.Location(path.as_uri(), to_range(span))
                for path, span in definition(analysis, line, column)] or None

    return server


def internal_error(exc: Exception) -> T.Diagnostic:
    from modulec.cli.guard import describe

    print(f"modulec lsp: internal compiler error: {describe(exc)}", file=sys.stderr)
    return T.Diagnostic(range=START, severity=T.DiagnosticSeverity.Error, source="modulec",
                        message=f"internal compiler error: {describe(exc)}\n"
                                "note: this is a bug in modulec; please report it")
