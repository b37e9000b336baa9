"""`modulec lsp`, driven over stdio as an editor drives it (JSON-RPC, Content-Length framing):
its diagnostics are those of `modulec check --format json`; hover; go-to-definition."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

pytest.importorskip("pygls")

TIMEOUT = 30  # seconds for any one answer: CI never hangs

GOOD = '''\
"""A tiny test model."""

from std.modules.norm import LayerNormParams
from std.modules.attention import CausalSelfAttention

block Tiny(d: int, heads: int, max_seq: int = 128):
  """One attention block."""

  params:
    ln: LayerNormParams(d, 1e-5)
    attn: CausalSelfAttention(d, heads, heads, max_seq)

  forward:
    in: x: [B, T, d]
    out: [B, T, d]

    graph:
      x -> ln -> h
      h -> attn -> a
      (x, a) -> add() -> out
'''

BROKEN = {  # each: one kind of error (syntax, names, imports, shapes with a secondary label)
    "syntax": GOOD.replace("-> a\n", "-> a ->\n"),
    "undefined": GOOD.replace("(x, a) -> add", "(x, b) -> add"),
    "import": GOOD.replace("std.modules.norm", "std.modules.nrm"),
    "shape": GOOD.replace("add() -> out", "add() -> h2\n      h2 -> matmul(x) -> out"),
}


class Client:
    """A minimal LSP client: requests wait for their answer; notifications are queued."""

    def __init__(self, cwd: Path) -> None:
        self.log = tempfile.TemporaryFile()  # the server's stderr (a pipe could fill up)
        self.proc = subprocess.Popen([sys.executable, "-m", "modulec", "lsp"], cwd=cwd,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log)
        self.inbox: queue.Queue = queue.Queue()
        self.next_id = 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        stream = self.proc.stdout
        while True:
            length = None
            while (line := stream.readline()) not in (b"\r\n", b""):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            if not line or length is None:
                return
            self.inbox.put(json.loads(stream.read(length)))

    def send(self, message: dict) -> None:
        body = json.dumps({"jsonrpc": "2.0", **message}).encode()
        self.proc.stdin.write(b"Content-Length: %d\r\n\r\n" % len(body) + body)
        self.proc.stdin.flush()

    def notify(self, method: str, params: dict | None = None) -> None:
        self.send({"method": method, "params": params})

    def request(self, method: str, params: dict | None = None):
        self.next_id += 1
        self.send({"id": self.next_id, "method": method, "params": params})
        answer = self.wait(lambda m: m.get("id") == self.next_id and "method" not in m)
        assert "error" not in answer, answer
        return answer["result"]

    def wait(self, wanted) -> dict:
        while True:
            try:
                message = self.inbox.get(timeout=TIMEOUT)
            except queue.Empty:
                self.log.seek(0)
                pytest.fail("the language server did not answer in time; its stderr:\n"
                            + self.log.read().decode(errors="replace")[-4000:])
            if "id" in message and "method" in message:  # a request to the client
                self.send({"id": message["id"], "result": None})
            elif wanted(message):
                return message

    def diagnostics(self, uri: str) -> list[dict]:
        note = self.wait(lambda m: m.get("method") == "textDocument/publishDiagnostics"
                         and m["params"]["uri"] == uri)
        return note["params"]["diagnostics"]

    def open(self, path: Path, text: str) -> list[dict]:
        self.notify("textDocument/didOpen", {"textDocument": {
            "uri": path.as_uri(), "languageId": "module", "version": 1, "text": text}})
        return self.diagnostics(path.as_uri())

    def close(self) -> int:
        """shutdown, then exit: the server must stop by itself."""
        try:
            assert self.request("shutdown") is None
            self.notify("exit")
            return self.proc.wait(timeout=TIMEOUT)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.proc.stdin.close()
            self.proc.stdout.close()
            self.log.close()


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("lsp")


@pytest.fixture(scope="module")
def client(folder):
    client = Client(folder)
    client.request("initialize", {"processId": None, "rootUri": folder.as_uri(),
                                  "capabilities": {}})
    client.notify("initialized", {})
    yield client
    assert client.close() == 0


def position(text: str, needle: str, line_with: str) -> dict:
    """The LSP position of `needle` on the first line containing `line_with`."""
    lines = text.splitlines()
    line = next(i for i, t in enumerate(lines) if line_with in t)
    return {"line": line, "character": lines[line].index(needle) + 1}


def check_json(path: Path) -> list[dict]:
    """What `modulec check --format json` reports for the file, as LSP would show it."""
    done = subprocess.run([sys.executable, "-m", "modulec", "check", "--format", "json",
                           str(path)], capture_output=True, text=True, timeout=TIMEOUT)
    found = []
    for line in done.stdout.splitlines():
        item = json.loads(line)
        span = next(s for s in item["spans"] if s["is_primary"])
        extra = [f"{c['level']}: {c['message']}" for c in item["children"]]
        found.append({"code": item["code"], "message": "\n".join([item["message"], *extra]),
                      "severity": 1 if item["level"] == "error" else 2, "range": {
                          "start": {"line": span["line_start"] - 1,
                                    "character": span["column_start"] - 1},
                          "end": {"line": span["line_end"] - 1,
                                  "character": span["column_end"] - 1}}})
    return found


@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_diagnostics_are_those_of_check(client, folder, kind):
    path = folder / f"{kind}.module"
    path.write_text(BROKEN[kind])
    expected = check_json(path)
    path.write_text(GOOD)  # the server must check the editor's text, not the file
    got = client.open(path, BROKEN[kind])
    assert expected and [{k: d.get(k) for k in expected[0]} for d in got] == expected
    assert all(d["source"] == "modulec" for d in got)

    client.notify("textDocument/didChange", {
        "textDocument": {"uri": path.as_uri(), "version": 2},
        "contentChanges": [{"text": GOOD}]})
    assert client.diagnostics(path.as_uri()) == []


def test_secondary_labels_are_related_information(client, folder):
    path = folder / "related.module"
    got = client.open(path, BROKEN["shape"])
    related = got[0]["relatedInformation"]
    assert {r["message"] for r in related} >= {"in this call to `matmul`"}
    assert all(r["location"]["uri"] == path.as_uri() for r in related)


def test_unsaved_imported_document_is_seen(client, folder):
    helper = folder / "helper.module"
    helper.write_text(GOOD)
    main = folder / "main.module"
    using = "from helper import Tiny2\n\n" + GOOD.split("\n\n", 1)[1].replace(
        "block Tiny(", "block Main(")
    assert client.open(helper, GOOD.replace("block Tiny(", "block Tiny2(")) == []
    assert client.open(main, using) == []


@pytest.fixture(scope="module")
def good(client, folder):
    path = folder / "good.module"
    assert client.open(path, GOOD) == []
    return path


def at(path: Path, text: str, needle: str, line_with: str | None = None) -> dict:
    return {"textDocument": {"uri": path.as_uri()},
            "position": position(text, needle, line_with or needle)}


def test_hover_shows_inferred_shape(client, good):
    for needle, line in [("h", "x -> ln -> h"), ("a", "(x, a)"), ("out", "add() -> out")]:
        result = client.request("textDocument/hover", at(good, GOOD, needle, line))
        assert f"{needle}: [B, T, d]" in result["contents"]["value"]


def test_hover_shows_declaration_and_input(client, good):
    result = client.request("textDocument/hover", at(good, GOOD, "CausalSelfAttention",
                                                     "attn: Causal"))
    assert "module CausalSelfAttention(" in result["contents"]["value"]
    result = client.request("textDocument/hover", at(good, GOOD, "x", "in: x"))
    assert "x: [B, T, d]" in result["contents"]["value"]
    result = client.request("textDocument/hover", at(good, GOOD, "max_seq", "heads, max_seq"))
    assert "max_seq: int = 128" in result["contents"]["value"]
    assert client.request("textDocument/hover", at(good, GOOD, "forward")) is None


def test_definition_of_std_module_and_import(client, good):
    result = client.request("textDocument/definition",
                            at(good, GOOD, "CausalSelfAttention", "attn: Causal"))
    assert len(result) == 1 and result[0]["uri"].endswith("/std/modules/attention.module")
    start = result[0]["range"]["start"]
    text = Path(unquote(urlparse(result[0]["uri"]).path)).read_text().splitlines()
    assert text[start["line"]][start["character"]:].startswith("CausalSelfAttention")

    result = client.request("textDocument/definition",
                            at(good, GOOD, "attention", "import CausalSelfAttention"))
    assert [r["uri"].rpartition("/std/")[2] for r in result] == ["modules/attention.module"]


def test_definition_of_primitive_and_tensor(client, good):
    result = client.request("textDocument/definition", at(good, GOOD, "add", "add()"))
    assert result[0]["uri"].endswith("/std/primitives/add.module")
    result = client.request("textDocument/definition", at(good, GOOD, "h", "h -> attn"))
    defined = position(GOOD, "> h", "x -> ln -> h")  # the `h` after `-> `
    line, column = defined["line"], defined["character"] + 1
    assert result == [{"uri": good.as_uri(), "range": {
        "start": {"line": line, "character": column},
        "end": {"line": line, "character": column + 1}}}]


def test_exit_without_shutdown_stops_the_server(folder):
    client = Client(folder)
    client.request("initialize", {"processId": None, "capabilities": {}})
    client.notify("exit")
    try:
        assert client.proc.wait(timeout=TIMEOUT) == 1  # LSP: exit before shutdown: status 1
    finally:
        client.proc.kill()
        client.proc.wait()
        client.proc.stdin.close()
        client.proc.stdout.close()
        client.log.close()
