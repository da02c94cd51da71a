"""Replicas as the operator's pods show them, for the autoscaling round of the reconcile pass.

The operator labels each engine pod with its model, pool, accelerator and role
(``hetsched.io/*``), sets ``HETSCHED_DEVICE`` and passes the TP degree as an
engine flag. :func:`replicas_from_pods` turns a pod list into the autoscaler's
:class:`~hetsched.autoscale.signals.Replica` values (URL from the pod IP and its
``http`` port, Ready from the pod's condition), keyed like the fleet's options.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from hetsched.autoscale.signals import Replica
from hetsched.specs.wire import Label, OptionKey, label_value

TP_FLAGS = ("--tensor-parallel-size", "--tp-size")
"""vLLM's and SGLang's TP flag."""
MANAGED = {Label.MANAGED_BY: Label.MANAGER}
"""The label selector of every object hetsched manages (Deployments, pods, Services, the PlacementPlan)."""


def replicas_from_pods(pods: Iterable[Mapping[str, Any]], options: Iterable[OptionKey]) -> list[Replica]:
    """The engine pods that belong to one of ``options`` (model key ``<namespace>/<name>``), as replicas.

    Pods that are finished, being deleted or match no option are left out.
    """
    index: dict[tuple[str, str, str, str], list[OptionKey]] = {}
    for key in options:
        index.setdefault((key.model, label_value(key.pool), key.device, key.role.value), []).append(key)
    out = []
    for pod in pods:
        meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
        labels = meta.get("labels") or {}
        if Label.MODEL not in labels or meta.get("deletionTimestamp") or status.get("phase") in ("Succeeded", "Failed"):
            continue
        container: Mapping[str, Any] = next(iter(spec.get("containers") or []), {})
        env = {e.get("name"): e.get("value") for e in container.get("env") or []}
        served = f"{meta.get('namespace')}/{labels[Label.MODEL]}"
        keys = index.get((served, labels.get(Label.POOL, ""), env.get("HETSCHED_DEVICE") or "",
                          labels.get(Label.ROLE, "")), [])
        option = _by_tp(keys, container.get("args") or [])
        if option is None:
            continue
        port = next((p.get("containerPort") for p in container.get("ports") or [] if p.get("name") == "http"), 8000)
        ip = status.get("podIP")
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
        out.append(Replica(name=f"{meta.get('namespace')}/{meta.get('name')}", key=option,
                           url=f"http://{ip}:{port}" if ip else "", ready=ready and bool(ip)))
    return out


def _by_tp(keys: list[OptionKey], args: list[str]) -> OptionKey | None:
    if len(keys) <= 1:
        return keys[0] if keys else None
    for flag in TP_FLAGS:
        if flag in args[:-1]:
            tp = args[args.index(flag) + 1]
            return next((k for k in keys if str(k.tp) == tp), None)
    return None


def replicas_in_cluster(deployments: Iterable[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]],
                        options: Iterable[OptionKey]) -> list[Replica]:
    """The pods as replicas, plus a not-Ready placeholder for each replica a Deployment asks for that has no pod yet.

    The placement the policy sees is then what the operator asked for: a
    Deployment just created or scaled up does not read as missing replicas
    (which would scale it up twice, or below its plan while its pods start).
    """
    keys = list(options)
    replicas = replicas_from_pods(pods, keys)
    have = Counter(r.key for r in replicas)
    for deployment in deployments:
        meta, spec = deployment.get("metadata") or {}, deployment.get("spec") or {}
        template = spec.get("template") or {}
        as_pod = {"metadata": {**(template.get("metadata") or {}), "namespace": meta.get("namespace"),
                               "name": meta.get("name")},
                  "spec": template.get("spec") or {}, "status": {}}
        found = replicas_from_pods([as_pod], keys)
        if not found:
            continue
        key = found[0].key
        missing = int(spec.get("replicas") or 0) - have[key]
        replicas += [Replica(name=f"{meta.get('namespace')}/{meta.get('name')}/pending-{i}", key=key, url="",
                             ready=False) for i in range(missing)]
        have[key] += max(missing, 0)
    return replicas
