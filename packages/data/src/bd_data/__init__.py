"""bd_data."""
