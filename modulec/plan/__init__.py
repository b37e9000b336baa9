"""Planning: memory (lifetimes, sharing, offsets, ordering); recompute and swap come next."""
