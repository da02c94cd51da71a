"""Cluster files into a ClusterSpec: hetsched's own format, Mélange's and AIBrix's (see ``interop``); plans back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hetsched.catalog import Catalog, load_catalog
from hetsched.errors import InputError
from hetsched.optimizer.interop import aibrix_cluster, is_aibrix, is_melange, melange_cluster, validate
from hetsched.optimizer.plan import Plan
from hetsched.optimizer.spec import ClusterSpec
from hetsched.specs.files import read_document


def load_cluster(path: str | Path, *, catalog: Catalog | None = None) -> ClusterSpec:
    """Read a cluster file (YAML or JSON, any of the formats); profile paths in it are relative to its folder."""
    file = Path(path)
    return parse_cluster(read_document(file, field="cluster"), source=file.name, catalog=catalog, base=file.parent)


def parse_cluster(raw: Any, *, source: str = "cluster", catalog: Catalog | None = None,
                  base: Path | None = None) -> ClusterSpec:
    """Validate a cluster mapping; errors name the field path, e.g. ``models[0].workload.rate_rps``.

    ``base`` is the folder the paths of an AIBrix file are read from; without one, only inline profiles are.
    """
    if not isinstance(raw, dict):
        raise InputError(f"{source}: expected a mapping with pools and models", field="cluster")
    if is_melange(raw):
        return melange_cluster(raw, source=source, catalog=catalog or load_catalog())
    if is_aibrix(raw):
        return aibrix_cluster(raw, source=source, catalog=catalog or load_catalog(), base=base)
    return validate(ClusterSpec, raw, source)


def load_plan(path: str | Path) -> Plan:
    """Read a plan written by ``hetsched plan -o json|yaml`` (e.g. the current one, for churn)."""
    return validate(Plan, read_document(path, field="current"), Path(path).name)
