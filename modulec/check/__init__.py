"""Checking: names, operations, types and shapes, contracts, annotations, weight mapping."""
