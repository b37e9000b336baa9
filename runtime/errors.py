"""Errors the runtime reports to users: a message and help lines, never a traceback
(the CLI renders them like compiler diagnostics)."""

from __future__ import annotations


class RuntimeUserError(Exception):
    """A problem with the user's program, weights or inputs."""

    def __init__(self, message: str, help: list[str] | None = None):
        super().__init__(message)
        self.message = message
        self.help = list(help or [])

    def __str__(self) -> str:
        """The message and its help lines: a Python caller sees the help too (the CLI
        prints `message` and `help` itself)."""
        return "\n".join([self.message, *(f"  help: {line}" for line in self.help)])


class NonFiniteError(RuntimeUserError):
    """An op produced NaN or Inf; the message names the op and its source line."""
