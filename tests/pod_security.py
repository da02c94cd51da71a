"""A policy check: does a pod spec meet Kubernetes' restricted Pod Security Standard (which includes baseline)?

The rules of https://kubernetes.io/docs/concepts/security/pod-security-standards/ (v1.33), checked on manifests
as written, plus a read-only root filesystem where asked for.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

VOLUME_TYPES = frozenset({"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                          "projected", "secret"})
SAFE_SYSCTLS = frozenset({"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range",
                          "net.ipv4.ip_unprivileged_port_start", "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range",
                          "net.ipv4.ip_local_reserved_ports",
                          "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                          "net.ipv4.tcp_keepalive_probes"})
SELINUX_TYPES = frozenset({"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"})
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}


def pod_specs(manifests: Iterable[Mapping[str, Any]]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """``(kind/name, pod spec)`` of every manifest that makes pods."""
    for doc in manifests:
        kind, name = doc.get("kind"), (doc.get("metadata") or {}).get("name")
        if kind == "Pod":
            yield f"{kind}/{name}", doc["spec"]
        elif kind in WORKLOADS:
            yield f"{kind}/{name}", doc["spec"]["template"]["spec"]
        elif kind == "CronJob":
            yield f"{kind}/{name}", doc["spec"]["jobTemplate"]["spec"]["template"]["spec"]


def restricted_violations(pod: Mapping[str, Any], *, read_only_root: bool = True) -> list[str]:
    """What in ``pod`` breaks the restricted standard (empty: it complies)."""
    problems: list[str] = []
    context = pod.get("securityContext") or {}
    problems += [f"{flag} is set" for flag in ("hostNetwork", "hostPID", "hostIPC") if pod.get(flag)]
    for volume in pod.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if not kinds <= VOLUME_TYPES:
            problems.append(f"volume {volume['name']} is of type {sorted(kinds - VOLUME_TYPES)}")
    problems += [f"sysctl {s['name']} is not safe" for s in context.get("sysctls") or []
                 if s["name"] not in SAFE_SYSCTLS]
    problems += _identity("pod", context)
    containers = [*(pod.get("initContainers") or []), *(pod.get("containers") or []),
                  *(pod.get("ephemeralContainers") or [])]
    for container in containers:
        where = f"container {container['name']}"
        own = container.get("securityContext") or {}
        if own.get("privileged"):
            problems.append(f"{where} is privileged")
        if own.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{where} does not set allowPrivilegeEscalation: false")
        capabilities = own.get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or []):
            problems.append(f"{where} does not drop ALL capabilities")
        if set(capabilities.get("add") or []) - {"NET_BIND_SERVICE"}:
            problems.append(f"{where} adds capabilities {capabilities['add']}")
        if own.get("runAsNonRoot", context.get("runAsNonRoot")) is not True:
            problems.append(f"{where} may run as root (runAsNonRoot is not true)")
        seccomp = (own.get("seccompProfile") or context.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            problems.append(f"{where} has seccomp profile {seccomp!r}, not RuntimeDefault or Localhost")
        if own.get("procMount", "Default") != "Default":
            problems.append(f"{where} sets procMount {own['procMount']}")
        problems += [f"{where} opens host port {p['hostPort']}" for p in container.get("ports") or []
                     if p.get("hostPort")]
        problems += _identity(where, own)
        if read_only_root and container in (pod.get("containers") or []) and not own.get("readOnlyRootFilesystem"):
            problems.append(f"{where} has a writable root filesystem")
    return problems


def _identity(where: str, context: Mapping[str, Any]) -> list[str]:
    problems = []
    if context.get("runAsUser") == 0:
        problems.append(f"{where} runs as user 0")
    if ((context.get("seLinuxOptions") or {}).get("type") or "") not in SELINUX_TYPES:
        problems.append(f"{where} sets SELinux type {context['seLinuxOptions']['type']}")
    if (context.get("appArmorProfile") or {}).get("type") == "Unconfined":
        problems.append(f"{where} runs unconfined by AppArmor")
    if (context.get("seccompProfile") or {}).get("type") == "Unconfined":
        problems.append(f"{where} runs without seccomp")
    return problems
