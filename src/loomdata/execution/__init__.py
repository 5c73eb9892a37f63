"""execution stage."""
