"""The runtime: stages, meshes, schedules and data parallelism built from a Layout under torchrun."""
