"""Intermediate representations: Graph IR (functional, §9.7.1) and Schedule IR (§9.7.2)."""
