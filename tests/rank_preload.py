"""What the fork server of tests/dist_testing.py `spawn` does once for every rank it forks:
import torch, the runtime, the compiler and the workers, build the parser's tables and
parse std/ into the parser's in-process memo (a rank builds its programs from std; each
fresh process spent ~0.5 s on the tables and std's files). Only imported there."""

from __future__ import annotations

import torch  # noqa: F401
import torch.distributed  # noqa: F401
import torch.multiprocessing  # noqa: F401

import runtime.model  # noqa: F401
import runtime.train.run  # noqa: F401
import tests.dist_workers  # noqa: F401
import tests.pipeline_workers  # noqa: F401
import tests.tp_workers  # noqa: F401
from modulec.paths import REPO_DIR
from modulec.resolve.resolver import _display_name, _read_and_parse

for _path in sorted((REPO_DIR / "std").rglob("*.module")):
    # as the resolver reads std (its memo is keyed by the shown name and the text: a file
    # edited since parses again)
    _read_and_parse(_path, _display_name(_path), cache=True)
