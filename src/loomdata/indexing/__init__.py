"""indexing stage."""
