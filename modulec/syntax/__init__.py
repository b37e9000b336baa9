"""Syntax: grammar-driven parsing into an immutable syntax tree, and its canonical printer."""
