"""``-o json``: every key a script reads is a string it can parse, never a Python repr."""

from __future__ import annotations

import json

from hetsched.autoscale.policy import ModelDecision, Reason, ReplicaCount
from hetsched.cli.autoscale import round_json
from hetsched.cli.output import to_jsonable
from hetsched.optimizer.spec import Role
from hetsched.specs.wire import OptionKey

A10G = OptionKey("llama-3.1-8b", "a10g", "a10g", 1, Role.UNIFIED)
L4 = OptionKey("llama-3.1-8b", "l4", "l4", 2, Role.UNIFIED)


def _decision() -> ModelDecision:
    return ModelDecision(model="llama-3.1-8b", desired={L4: 1, A10G: 3}, reason=Reason.SCALE_UP,
                         message="demand 4.0 req/s above capacity", demand_rps=4.0, needed_rps=4.4,
                         capacity_rps=4.5, unmet_rps=0.0, attainment=None, correction={A10G: 0.8},
                         observed_ttft_ms=None, observed_tpot_ms=None, panic=False, stale_pods=0, shares={})


def test_an_autoscale_round_names_the_fields_of_each_option() -> None:
    line = json.dumps(round_json(_decision(), {A10G: ReplicaCount(desired=2, ready=1)}, time_s=12.34))
    round_ = json.loads(line)
    assert "(" not in line and "<Role" not in line
    assert round_["time_s"] == 12.3 and round_["reason"] == "scale-up"
    assert round_["desired"] == [{"pool": "a10g", "device": "a10g", "tp": 1, "role": "unified", "replicas": 3},
                                 {"pool": "l4", "device": "l4", "tp": 2, "role": "unified", "replicas": 1}]
    assert round_["correction"] == [{"pool": "a10g", "device": "a10g", "tp": 1, "role": "unified", "factor": 0.8}]
    assert round_["replicas"] == [{"pool": "a10g", "device": "a10g", "tp": 1, "replicas": 2, "ready": 1}]


def test_a_mapping_keyed_by_tuples_becomes_a_list_of_keys_and_values() -> None:
    assert to_jsonable({A10G: 3}) == [{"key": ["llama-3.1-8b", "a10g", "a10g", 1, "unified"], "value": 3}]
    assert to_jsonable({Role.DECODE: 1.5, 2: "x"}) == {"decode": 1.5, "2": "x"}
