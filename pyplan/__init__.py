"""pyplan."""
