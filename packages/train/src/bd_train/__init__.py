"""bd_train."""
