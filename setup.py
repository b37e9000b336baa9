"""Packaging hook: the grammar, the standard library and the error pages ship inside the
package (`modulec/_data/`, read through `modulec.paths.data_dir`), copied at build time so
the repository keeps one copy of each. Metadata lives in pyproject.toml."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
DATA = {"grammar": ROOT / "grammar", "std": ROOT / "std", "docs/errors": ROOT / "docs" / "errors"}


class BuildWithData(build_py):
    def run(self):
        super().run()
        target = Path(self.build_lib) / "modulec" / "_data"
        for name, source in DATA.items():
            destination = target / name
            if destination.exists():
                shutil.rmtree(destination)
            shutil.copytree(source, destination,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "node_modules"))


setup(cmdclass={"build_py": BuildWithData})
