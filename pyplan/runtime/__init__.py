"""The runtime: stages, meshes, schedules and data parallelism built from a Layout under torchrun."""

from pyplan.runtime.remat import RematModule, apply_remat

__all__ = ["RematModule", "apply_remat"]
