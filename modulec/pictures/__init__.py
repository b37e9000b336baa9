"""Pictures of what the compiler built (issue 7): the Graph IR as graphviz (`modulec graph`)
and the memory plan of a training step (`modulec plan --picture`).

`select` picks the function pair (a forward function and its derived backward) a picture
shows; `dot` writes the Graph IR as DOT text and `render` runs graphviz's `dot` on it;
`memory` draws the memory plan on a `canvas`, written as SVG (plain text) or PNG (Pillow).
Everything here is deterministic: the same graph gives the same bytes.
"""


import click


class PictureError(click.ClickException):
    """A picture that cannot be made as asked (graphviz or Pillow missing, an unknown
    function): a usage problem, not a compiler bug. Uncaught in a command, click reports
    it and exits with status 2 (`modulec graph` writes it rustc-style itself)."""

    exit_code = 2
