"""The API calls that make the cluster hold what reconcile wants: create, merge-patch or delete, none when it
already does."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hetsched.operator.objects import Action, Change, Desired, Observed, key_of, labels_of, taints_of
from hetsched.operator.resources import quantity_value
from hetsched.specs.wire import Label


QUANTITY_FIELDS = frozenset({"requests", "limits", "sizeLimit"})
"""Fields whose values are resource quantities: the API server stores them canonically (``0.5`` as ``500m``)."""


def is_subset(want: Any, have: Any, *, quantity: bool = False) -> bool:
    """Whether ``have`` already holds everything ``want`` sets (the server may add defaults around it, and
    rewrites ``quantity`` values in canonical form, so those compare by amount)."""
    if isinstance(want, dict):
        return isinstance(have, dict) and all(is_subset(v, have.get(k), quantity=quantity or k in QUANTITY_FIELDS)
                                              for k, v in want.items())
    if isinstance(want, list):
        return isinstance(have, list) and len(want) == len(have) and all(
            is_subset(w, h, quantity=quantity) for w, h in zip(want, have))
    if quantity and isinstance(want, str) and isinstance(have, str):
        amount = quantity_value(want)
        return want == have or (amount is not None and amount == quantity_value(have))
    if isinstance(want, int | float) and isinstance(have, int | float) and not isinstance(want, bool):
        return float(want) == float(have)
    return bool(want == have)


def _managed(obj: Mapping[str, Any]) -> bool:
    return labels_of(obj).get(Label.MANAGED_BY) == Label.MANAGER


def changes(desired: Desired, observed: Observed, *, mig_configmap: tuple[str, str] | None = None,
            dcm_configmap: tuple[str, str] | None = None) -> list[Change]:
    """The API calls that make the cluster match ``desired``; none when it already does."""
    out: list[Change] = []
    for kind, wanted, have in (("Deployment", desired.deployments, observed.deployments),
                               ("Service", desired.services, observed.services),
                               ("PodDisruptionBudget", desired.disruption_budgets, observed.disruption_budgets),
                               ("InferencePool", desired.inference_pools, observed.inference_pools or ())):
        existing = {key_of(o): o for o in have if _managed(o)}
        wanted_keys = set()
        for body in wanted:
            key = key_of(body)
            wanted_keys.add(key)
            current = existing.get(key)
            if current is None:
                out.append(Change(Action.CREATE, kind, key[0], key[1], body))
            elif not is_subset(body, current):
                out.append(Change(Action.PATCH, kind, key[0], key[1], body))
        for key in sorted(set(existing) - wanted_keys):
            out.append(Change(Action.DELETE, kind, key[0], key[1]))
    nodes = {key_of(n)[1]: n for n in observed.nodes}
    for node_name, labels in sorted(desired.node_labels.items()):
        if not is_subset(labels, labels_of(nodes.get(node_name) or {})):
            out.append(Change(Action.PATCH, "Node", None, node_name, {"metadata": {"labels": labels}}))
    for node_name, taints in sorted(desired.node_taints.items()):
        if taints_of(nodes.get(node_name)) != taints:
            out.append(Change(Action.PATCH, "Node", None, node_name, {"spec": {"taints": taints}}))
    for data, configmap, where in ((desired.mig_configmap, observed.mig_configmap, mig_configmap),
                                   (desired.dcm_configmap, observed.dcm_configmap, dcm_configmap)):
        if data is None or where is None:
            continue
        namespace, name = where
        body = {"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": name, "namespace": namespace, "labels": {Label.MANAGED_BY: Label.MANAGER}},
                "data": data}
        if configmap is None:
            out.append(Change(Action.CREATE, "ConfigMap", namespace, name, body))
        elif not is_subset(data, configmap.get("data")):
            out.append(Change(Action.PATCH, "ConfigMap", namespace, name, {"data": data}))
    out.sort(key=lambda c: c.kind == "Node")  # node labels last: the ConfigMap they name must exist first
    return out
