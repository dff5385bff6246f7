"""training package."""
