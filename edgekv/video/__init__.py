"""video."""
