"""Helpers shared by the web planner's tests."""

from __future__ import annotations

from hetsched.optimizer.build import CapacityQuery
from hetsched.specs.dtypes import DType


def scaled_capacity(query: CapacityQuery) -> float:
    """A deterministic capacity source: 4 req/s per 1000 dense bf16 TFLOP/s of the device (a MIG slice: its share)."""
    return 4.0 * query.device.peak_tflops(DType.BF16) / 1000 * query.tp
