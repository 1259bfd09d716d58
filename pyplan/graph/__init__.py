"""Tracing a model into a LayerGraph and linearizing it into a Chain of blocks."""
