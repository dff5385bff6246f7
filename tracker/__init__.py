"""tracker package."""
