"""Types of the checker: symbolic dimensions, dtypes and tensor types."""
