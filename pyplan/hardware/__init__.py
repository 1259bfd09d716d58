"""Hardware knowledge: the catalog of GPUs, links and priced cloud instances, and the Cluster a plan runs on."""

from __future__ import annotations

from pyplan.hardware.catalog import (
    DTYPES,
    GIB,
    GPU,
    Catalog,
    Instance,
    Link,
    Money,
    cache_dir,
    convert,
    get_gpu,
    get_instance,
    get_link,
    list_gpus,
    list_instances,
    list_links,
    load_catalog,
    local_calibration_path,
    local_gpu,
    local_link,
    total,
)
from pyplan.hardware.cluster import Cluster, NodeGroup

__all__ = [
    "DTYPES",
    "GIB",
    "GPU",
    "Catalog",
    "Cluster",
    "Instance",
    "Link",
    "Money",
    "NodeGroup",
    "cache_dir",
    "convert",
    "get_gpu",
    "get_instance",
    "get_link",
    "list_gpus",
    "list_instances",
    "list_links",
    "load_catalog",
    "local_calibration_path",
    "local_gpu",
    "local_link",
    "total",
]
