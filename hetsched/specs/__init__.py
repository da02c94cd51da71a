"""Typed specifications: model architectures, accelerators, dtypes."""
