"""The accelerator catalog: data files with a loader, and pure queries over them."""

from hetsched.catalog.loader import Catalog, host_catalog, load_catalog
from hetsched.catalog.types import Accelerator, AmdPartitioning, Device, MigGeometry, MigProfile, Vendor

__all__ = ["Accelerator", "AmdPartitioning", "Catalog", "Device", "MigGeometry", "MigProfile", "Vendor",
           "host_catalog", "load_catalog"]
