"""hetsched: serve LLMs on heterogeneous accelerators at the lowest cost that meets every SLO."""

__version__ = "0.1.0"
