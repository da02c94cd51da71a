"""The wire contract: the key replicas are counted by."""

from __future__ import annotations

import json

from hetsched.specs.wire import OptionKey, Role


def test_an_option_key_reads_by_name_and_compares_as_its_fields() -> None:
    key = OptionKey("serving/chat", "h100", "h100-sxm:3g.40gb", 1, Role.DECODE)
    assert (key.model, key.pool, key.device, key.tp, key.role) == tuple(key)
    assert sorted([key, key._replace(tp=2), key._replace(pool="a100")]) == [
        key._replace(pool="a100"), key, key._replace(tp=2)]
    assert json.dumps(key) == '["serving/chat", "h100", "h100-sxm:3g.40gb", 1, "decode"]'
