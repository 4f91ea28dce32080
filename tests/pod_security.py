"""A checker of the Kubernetes Pod Security Standards (``restricted``, latest), written from the
documented rules (kubernetes.io/docs/concepts/security/pod-security-standards/), so that tests
can check every pod spec h5ngff creates without an API server's PodSecurity admission.

``violations(pod_spec, annotations)`` returns one message per broken rule (empty = compliant).
Each check names its control as the documentation does. The baseline controls are all part of
``restricted``; ``restricted`` adds volume types, privilege escalation, non-root, seccomp and
capabilities. Windows-only fields (hostProcess) are checked too.
"""

from __future__ import annotations

from typing import Any, Iterator

#: Baseline "Capabilities": what a container may add (the container runtime's default set).
BASELINE_CAPABILITIES = {
    "AUDIT_WRITE",
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    "KILL",
    "MKNOD",
    "NET_BIND_SERVICE",
    "SETFCAP",
    "SETGID",
    "SETPCAP",
    "SETUID",
    "SYS_CHROOT",
}
#: Restricted "Capabilities": drop ALL, add at most NET_BIND_SERVICE.
RESTRICTED_ADD = {"NET_BIND_SERVICE"}
#: Baseline "Sysctls": the safe set (as of Kubernetes 1.29+).
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}
#: Baseline "SELinux": allowed types (user and role must be unset).
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
#: Restricted "Volume Types": the only volume sources allowed.
RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
SECCOMP_OK = {"RuntimeDefault", "Localhost"}
APPARMOR_PREFIX = "container.apparmor.security.beta.kubernetes.io/"


def _containers(pod: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for kind in ("initContainers", "containers", "ephemeralContainers"):
        for c in pod.get(kind) or ():
            yield f"{kind}[{c.get('name', '?')}]", c


def _baseline(pod: dict[str, Any], annotations: dict[str, str]) -> list[str]:
    out = []
    psc = pod.get("securityContext") or {}
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field):
            out.append(f"Host Namespaces: spec.{field} must be unset or false")
    if (psc.get("windowsOptions") or {}).get("hostProcess"):
        out.append("HostProcess: spec.securityContext.windowsOptions.hostProcess must be unset or false")
    for v in pod.get("volumes") or ():
        if "hostPath" in v:
            out.append(f"HostPath Volumes: volume {v.get('name')!r} is a hostPath")
    for key, value in annotations.items():
        if key.startswith(APPARMOR_PREFIX) and value != "runtime/default" and not value.startswith("localhost/"):
            out.append(f"AppArmor: annotation {key}={value!r}")
    out += _apparmor_selinux_seccomp("spec.securityContext", psc)
    for sysctl in psc.get("sysctls") or ():
        if sysctl.get("name") not in SAFE_SYSCTLS:
            out.append(f"Sysctls: {sysctl.get('name')!r} is not in the safe set")
    for where, c in _containers(pod):
        sc = c.get("securityContext") or {}
        if sc.get("privileged"):
            out.append(f"Privileged Containers: {where}.securityContext.privileged must be unset or false")
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            out.append(f"HostProcess: {where}.securityContext.windowsOptions.hostProcess must be unset or false")
        added = set((sc.get("capabilities") or {}).get("add") or ()) - BASELINE_CAPABILITIES
        if added:
            out.append(f"Capabilities: {where} adds {sorted(added)}")
        for port in c.get("ports") or ():
            if port.get("hostPort"):
                out.append(f"Host Ports: {where} uses hostPort {port['hostPort']}")
        if sc.get("procMount") not in (None, "Default"):
            out.append(f"/proc Mount Type: {where}.securityContext.procMount must be unset or Default")
        out += _apparmor_selinux_seccomp(f"{where}.securityContext", sc)
    return out


def _apparmor_selinux_seccomp(where: str, sc: dict[str, Any]) -> list[str]:
    out = []
    apparmor = (sc.get("appArmorProfile") or {}).get("type")
    if apparmor not in (None, "RuntimeDefault", "Localhost"):
        out.append(f"AppArmor: {where}.appArmorProfile.type is {apparmor!r}")
    selinux = sc.get("seLinuxOptions") or {}
    if selinux.get("type", "") not in SELINUX_TYPES or selinux.get("user") or selinux.get("role"):
        out.append(f"SELinux: {where}.seLinuxOptions {selinux!r}")
    if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
        out.append(f"Seccomp: {where}.seccompProfile.type must not be Unconfined")
    return out


def _restricted(pod: dict[str, Any]) -> list[str]:
    out = []
    psc = pod.get("securityContext") or {}
    for v in pod.get("volumes") or ():
        kinds = set(v) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            out.append(f"Volume Types: volume {v.get('name')!r} is {sorted(kinds - RESTRICTED_VOLUMES)}")
    if psc.get("runAsUser") == 0:
        out.append("Running as Non-root user: spec.securityContext.runAsUser must not be 0")
    pod_nonroot = psc.get("runAsNonRoot") is True
    pod_seccomp = (psc.get("seccompProfile") or {}).get("type") in SECCOMP_OK
    for where, c in _containers(pod):
        sc = c.get("securityContext") or {}
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"Privilege Escalation: {where}.securityContext.allowPrivilegeEscalation must be false")
        nonroot = sc.get("runAsNonRoot")
        if nonroot is False or (nonroot is None and not pod_nonroot):
            out.append(f"Running as Non-root: {where} must run with runAsNonRoot true (pod or container)")
        if sc.get("runAsUser") == 0:
            out.append(f"Running as Non-root user: {where}.securityContext.runAsUser must not be 0")
        seccomp = (sc.get("seccompProfile") or {}).get("type")
        if not (seccomp in SECCOMP_OK or (seccomp is None and pod_seccomp)):
            out.append(f"Seccomp: {where} needs seccompProfile RuntimeDefault or Localhost (pod or container)")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or ()):
            out.append(f"Capabilities: {where}.securityContext.capabilities.drop must include ALL")
        added = set(caps.get("add") or ()) - RESTRICTED_ADD
        if added:
            out.append(f"Capabilities: {where} may add only NET_BIND_SERVICE, adds {sorted(added)}")
    return out


def violations(pod_spec: dict[str, Any], annotations: dict[str, str] | None = None) -> list[str]:
    """Every ``restricted`` (latest) rule ``pod_spec`` breaks; [] when it complies."""
    return _baseline(pod_spec, annotations or {}) + _restricted(pod_spec)


def pod_specs(obj: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any], dict[str, str]]]:
    """(where, pod spec, pod annotations) of every pod template in a Kubernetes object h5ngff
    creates or ships: Job, Deployment, DaskCluster (scheduler and workers), Pod."""
    kind, spec = obj.get("kind"), obj.get("spec") or {}
    name = f"{kind}/{(obj.get('metadata') or {}).get('name')}"
    if kind == "Pod":
        yield name, spec, (obj.get("metadata") or {}).get("annotations") or {}
    elif kind in ("Job", "Deployment", "StatefulSet", "DaemonSet", "ReplicaSet"):
        template = spec.get("template") or {}
        yield name, template.get("spec") or {}, (template.get("metadata") or {}).get("annotations") or {}
    elif kind == "DaskCluster":
        yield f"{name} scheduler", spec["scheduler"]["spec"], {}
        yield f"{name} worker", spec["worker"]["spec"], {}
