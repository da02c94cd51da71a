"""The profiler: per-operator latency tables of a model on a device, as a step-latency model.

Three sources make the same :class:`Profile`: ``kernel`` (operators timed on
the device in worker processes, :func:`hetsched.profiler.driver.profile_kernels`),
``roofline`` (catalog numbers, :func:`hetsched.profiler.roofline_source.roofline_profile`)
and ``endpoint`` (a load test of a live server, :func:`hetsched.profiler.endpoint.profile_endpoint`).
Store and load them with :mod:`hetsched.store.profiles`.
"""

from hetsched.profiler.profile import (Measurement, OpTable, PointFailure, Profile, ProfileSource, Provenance, Term,
                                       Variable)

__all__ = ["Measurement", "OpTable", "PointFailure", "Profile", "ProfileSource", "Provenance", "Term", "Variable"]
