"""Cluster files into a ClusterSpec: hetsched's own format, Mélange's and AIBrix's (see ``interop``); plans back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hetsched.catalog import Catalog, load_catalog
from hetsched.errors import InputError, SpecError
from hetsched.optimizer.interop import aibrix_cluster, is_aibrix, is_melange, melange_cluster, validate
from hetsched.optimizer.plan import Plan
from hetsched.optimizer.spec import ClusterSpec
from hetsched.specs.files import parse_json, read_document, read_text
from hetsched.specs.hf import parse_hf_config
from hetsched.specs.registry import bundled_model_names


def load_cluster(path: str | Path, *, catalog: Catalog | None = None) -> ClusterSpec:
    """Read a cluster file (YAML or JSON, any of the formats); profile paths in it are relative to its folder."""
    file = Path(path)
    return parse_cluster(read_document(file, field="cluster"), source=file.name, catalog=catalog, base=file.parent)


def parse_cluster(raw: Any, *, source: str = "cluster", catalog: Catalog | None = None,
                  base: Path | None = None) -> ClusterSpec:
    """Validate a cluster mapping; errors name the field path, e.g. ``models[0].workload.rate_rps``.

    ``base`` is the folder the file's paths are relative to (an AIBrix file's profiles, a model's config.json);
    without one, only inline profiles are read and a model path is left for the current folder.
    """
    if not isinstance(raw, dict):
        raise InputError(f"{source}: expected a mapping with pools and models", field="cluster")
    if is_melange(raw):
        return melange_cluster(raw, source=source, catalog=catalog or load_catalog())
    if is_aibrix(raw):
        return aibrix_cluster(raw, source=source, catalog=catalog or load_catalog(), base=base)
    spec = validate(ClusterSpec, raw, source)
    return spec if base is None else _inline_model_files(spec, base)


def _inline_model_files(spec: ClusterSpec, base: Path) -> ClusterSpec:
    """Models named by the path of a config.json (or its folder), read relative to ``base`` and carried inline,
    so the spec stands on its own wherever it is solved or stored: a saved plan re-solves in the web planner."""
    bundled = set(bundled_model_names())
    models = []
    for i, model in enumerate(spec.models):
        if model.config is None and model.model is not None and model.model not in bundled:
            given = base / model.model  # an absolute path stays itself
            path = given / "config.json" if given.is_dir() else given
            field = f"models[{i}].model"
            if path.exists() and not path.is_file():
                raise InputError(f"{path} is not a regular file: expected a config.json or a folder holding one",
                                 field=field)
            if not path.exists() and (given.is_dir() or _names_a_file(model.model)):
                raise InputError(f"no such file: {path} (expected a bundled model, a config.json or a folder "
                                 "holding one)", field=field)
            if path.is_file():
                config = parse_json(read_text(path, field=field), name=model.model, field=field)
                if not isinstance(config, dict):
                    raise InputError(f"{model.model} holds no config.json object", field=field)
                try:  # a mistake in the file is reported against the field that names it, not as an inline config
                    parse_hf_config(config, name=model.name, source=str(path))
                except SpecError as exc:
                    raise InputError(str(exc), field=field) from exc
                model = model.model_copy(update={"config": config})
        models.append(model)
    return spec.model_copy(update={"models": models})


def _names_a_file(value: str) -> bool:
    """A model written as a path (absolute, relative with ./ or ../, or a .json file), not a Hugging Face id."""
    return value.startswith(("/", "./", "../", "~")) or value.endswith(".json")


def load_plan(path: str | Path) -> Plan:
    """Read a plan written by ``hetsched plan -o json|yaml`` (e.g. the current one, for churn)."""
    return validate(Plan, read_document(path, field="current"), Path(path).name)
