"""Find a model by bundled name or by path to a config.json."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from hetsched.errors import InputError, NotFoundError, SpecError
from hetsched.specs.files import parse_json, read_text
from hetsched.specs.hf import parse_hf_config
from hetsched.specs.model import ModelArch

_BUNDLE = resources.files("hetsched.specs") / "models"


def bundled_model_names() -> list[str]:
    """Names of the configs shipped with hetsched, sorted."""
    return sorted(p.name.removesuffix(".json") for p in _BUNDLE.iterdir() if p.name.endswith(".json"))


def load_model(name_or_path: str) -> ModelArch:
    """Load a bundled model by name, or a config.json (or its folder) by path."""
    if name_or_path in bundled_model_names():  # a name, never a path out of the bundle
        text = (_BUNDLE / f"{name_or_path}.json").read_text()
        return _parse_text(text, name=name_or_path, source=f"bundled {name_or_path}")
    path = Path(name_or_path)
    try:
        if path.is_dir():
            path = path / "config.json"
        found = path.is_file()
    except OSError:  # a name too long to be a path
        found = False
    if found:
        name = path.parent.name if path.name == "config.json" else path.stem
        return _parse_text(read_text(path, field="model"), name=name, source=str(path))
    raise NotFoundError("model", name_or_path, bundled_model_names(),
                        hint="give a bundled name from 'hetsched models list' or a path to a config.json")


def parse_model_json(text: str, *, name: str, source: str = "upload") -> ModelArch:
    """Parse config.json text (e.g. an upload) into a ModelArch."""
    return _parse_text(text, name=name, source=source)


def _parse_text(text: str, *, name: str, source: str) -> ModelArch:
    try:
        raw = parse_json(text, name=source, field="config.json")
    except InputError as exc:
        raise SpecError(str(exc).removeprefix(f"{exc.field}: "), field=exc.field) from exc
    return parse_hf_config(raw, name=name, source=source)
