"""Inference engines' Prometheus signals, read once for every component that needs them.

vLLM and SGLang metric names, the parser of ``/metrics`` text and of a
Prometheus query response (:mod:`~hetsched.engine_metrics.parse`), and the
histogram arithmetic (:mod:`~hetsched.engine_metrics.types`). The router reads
them to route, the autoscaler to scale; neither owns them. (Device telemetry,
what NVML and amdsmi report, is :mod:`hetsched.backends.telemetry`.)
"""
