"""Kubernetes operator: CRD types, pure reconcile functions, and a thin kopf shell."""
