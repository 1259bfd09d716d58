"""Emission: the plan file (plan.json) and, later, the training script."""
