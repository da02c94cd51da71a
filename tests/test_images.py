"""Container images and the profiler Job template: consistent with the CLI and valid Kubernetes."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from hetsched.catalog import load_catalog
from hetsched.cli import COMMANDS, loaded_commands

ROOT = Path(__file__).parent.parent


@pytest.mark.parametrize("vendor", ["nvidia", "rocm", "cpu"])
def test_worker_images_run_the_profiler_with_their_backend(vendor: str) -> None:
    dockerfile = (ROOT / "backends" / vendor / "Dockerfile").read_text()
    assert f'ENTRYPOINT ["hetsched", "profile", "--backend", "{vendor}"]' in dockerfile
    assert "'.[profile]'" in dockerfile


def test_profiler_job_validates_and_targets_a_catalog_accelerator() -> None:
    job = yaml.safe_load((ROOT / "profiler" / "job.yaml").read_text())
    kubernetes_validate.validate(job, "1.33", strict=True)
    pod = job["spec"]["template"]["spec"]
    product = pod["nodeSelector"]["nvidia.com/gpu.product"]
    accelerator = load_catalog().by_product(product)
    assert accelerator is not None and accelerator.id == job["metadata"]["labels"]["hetsched.io/accelerator"]
    container = pod["containers"][0]
    assert container["resources"]["limits"][accelerator.resource_name] == "1"
    env = {e["name"] for e in container["env"]}
    assert "HETSCHED_DATABASE_URL" in env


def test_profiler_job_args_are_options_of_the_profile_command() -> None:
    job = yaml.safe_load((ROOT / "profiler" / "job.yaml").read_text())
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    profile = loaded_commands(COMMANDS["profile"][0])["profile"]  # the root group lists commands without loading them
    known = {flag for param in profile.params for flag in param.opts}
    assert {"--backend", "--device"} <= known
    assert {a for a in args if a.startswith("--")} <= known
