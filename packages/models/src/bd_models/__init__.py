"""bd_models."""
