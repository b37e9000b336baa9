"""Lowering: checked instances -> Graph IR (with the derived backward) -> Schedule IR."""
