"""A ModelDeployment's quantization is a DType: the same spellings as before, fp32 refused, the same CRD enum."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from hetsched.operator.resources import QUANTIZATIONS, ModelDeploymentSpec
from hetsched.specs.dtypes import DType

SPEC = {"model": "llama-3.1-8b", "engine": {"image": "vllm/vllm-openai"}, "slo": {"ttft": "500ms", "tpot": "50ms"},
        "workload": {"rateRps": 1, "inputTokens": 512, "outputTokens": 128}}


@pytest.mark.parametrize("name", ["bf16", "fp16", "fp8", "int8", "int4", "mxfp4", "nvfp4"])
def test_every_former_spelling_is_accepted_as_the_dtype(name: str) -> None:
    spec = ModelDeploymentSpec.model_validate({**SPEC, "quantization": name})
    assert spec.quantization is DType(name)
    assert spec.model_dump(mode="json", by_alias=True)["quantization"] == name


@pytest.mark.parametrize("name", ["fp32", "float8", "q4", 4, [1]])
def test_other_values_are_refused_naming_the_formats(name: object) -> None:
    with pytest.raises(ValidationError, match="(?s)quantization.*expected one of bf16, fp16, fp8, int8, int4, mxfp4, nvfp4"):
        ModelDeploymentSpec.model_validate({**SPEC, "quantization": name})


def test_the_crd_lists_the_formats_as_an_enum() -> None:
    schema = ModelDeploymentSpec.model_json_schema(by_alias=True)
    options = schema["properties"]["quantization"]["anyOf"]
    assert {"enum": [d.value for d in QUANTIZATIONS], "type": "string"} in options
