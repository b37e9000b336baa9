"""modulec: compiler toolchain for the Module DSL."""

__version__ = "0.1.0"
