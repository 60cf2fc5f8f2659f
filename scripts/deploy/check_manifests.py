#!/usr/bin/env python3
"""Validate rendered Helm manifests (one file per values file).

Each object is checked against the Kubernetes OpenAPI schemas bundled in the
`kubernetes-validate` package (strict: an unknown field fails), for every
Kubernetes version given; a ServiceMonitor against the CRD schema of the
Prometheus Operator (its module, from the Go proxy). Then the chart's own
promises, per shape:

- delayd's container is Pod Security "restricted": numeric non-root user,
  read-only root filesystem, no privilege escalation, all capabilities
  dropped, seccomp RuntimeDefault; with requests, a memory limit, a startup
  probe and a liveness probe on /healthz;
- sidecar: delayd is an init container with restartPolicy Always and no
  readiness probe (a broker away must not take the application's pods out
  of their Service), and no PersistentVolumeClaim;
- standalone: a Deployment with a readiness probe on /readyz, no claim;
- statefulset: a StatefulSet with a claim template mounted at the WAL;
- every shape has a PodDisruptionBudget and a ServiceMonitor whose selector
  matches a Service exposing the admin port.

usage: check_manifests.py SERVICEMONITOR_CRD.yaml K8S_VERSIONS FILE...
       (K8S_VERSIONS: comma-separated, e.g. 1.29.0,1.37.0)
"""
import sys

import jsonschema
import kubernetes_validate
import yaml

RESTRICTED = {
    "runAsNonRoot": True,
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
}


def fail(where, message):
    raise SystemExit(f"{where}: {message}")


def crd_schema(path):
    with open(path) as f:
        crd = yaml.safe_load(f)
    for version in crd["spec"]["versions"]:
        if version["name"] == "v1":
            return version["schema"]["openAPIV3Schema"]
    raise SystemExit(f"{path}: no v1 schema")


def check_restricted(where, c, pod):
    sc = c.get("securityContext") or {}
    psc = pod.get("securityContext") or {}
    for key, want in RESTRICTED.items():
        if sc.get(key) != want:
            fail(where, f"securityContext.{key} must be {want}, is {sc.get(key)}")
    user = sc.get("runAsUser", psc.get("runAsUser"))
    if not isinstance(user, int) or user == 0:
        fail(where, f"runAsUser must be a non-zero number, is {user!r}")
    if (sc.get("capabilities") or {}).get("drop") != ["ALL"]:
        fail(where, "capabilities.drop must be [ALL]")
    seccomp = (sc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type")
    if seccomp != "RuntimeDefault":
        fail(where, f"seccompProfile must be RuntimeDefault, is {seccomp}")


def probe_path(probe):
    return ((probe or {}).get("httpGet") or {}).get("path")


def check_file(path, crd, versions):
    with open(path) as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    kinds = {}
    for d in docs:
        where = f"{path}: {d['kind']}/{d['metadata']['name']}"
        if d["apiVersion"].startswith("monitoring.coreos.com/"):
            try:
                jsonschema.validate(d, crd)
            except jsonschema.ValidationError as e:
                fail(where, f"does not match the ServiceMonitor CRD: {e.message}")
        else:
            for v in versions:
                try:
                    kubernetes_validate.validate(d, v, strict=True)
                except kubernetes_validate.ValidationError as e:
                    fail(where, f"invalid for Kubernetes {v}: {e.message} at {list(e.path)}")
        kinds.setdefault(d["kind"], []).append(d)

    workloads = kinds.get("Deployment", []) + kinds.get("StatefulSet", [])
    if len(workloads) != 1:
        fail(path, f"expected one Deployment or StatefulSet, found {len(workloads)}")
    w = workloads[0]
    pod = w["spec"]["template"]["spec"]
    init = [c for c in pod.get("initContainers", []) if c["name"] == "delayd"]
    main = [c for c in pod.get("containers", []) if c["name"] == "delayd"]
    if len(init) + len(main) != 1:
        fail(path, "expected exactly one delayd container")
    sidecar = bool(init)
    c = (init or main)[0]
    where = f"{path}: {w['kind']}/{w['metadata']['name']} container delayd"
    check_restricted(where, c, pod)
    res = c.get("resources") or {}
    if "memory" not in res.get("limits", {}) or "memory" not in res.get("requests", {}):
        fail(where, "needs a memory request and limit")
    if probe_path(c.get("startupProbe")) != "/healthz":
        fail(where, "needs a startupProbe on /healthz")
    if probe_path(c.get("livenessProbe")) != "/healthz":
        fail(where, "needs a livenessProbe on /healthz")
    claims = [v for v in pod.get("volumes", []) if "persistentVolumeClaim" in v]
    if sidecar:
        if c.get("restartPolicy") != "Always":
            fail(where, "a native sidecar needs restartPolicy: Always")
        if "readinessProbe" in c:
            fail(where, "the sidecar must have no readinessProbe (a broker away would take the app's pods out)")
        if not pod.get("containers"):
            fail(where, "the sidecar shape needs the application's containers")
    elif probe_path(c.get("readinessProbe")) != "/readyz":
        fail(where, "needs a readinessProbe on /readyz")
    if w["kind"] == "StatefulSet":
        templates = [t["metadata"]["name"] for t in w["spec"].get("volumeClaimTemplates", [])]
        mounts = {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}
        if "wal" not in templates or mounts.get("wal") != "/var/lib/delayd":
            fail(where, "the StatefulSet needs the claim template wal mounted at /var/lib/delayd")
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        if env.get("DELAYD_STORE__KIND") != "local":
            fail(where, "the StatefulSet keeps the WAL: store.kind local")
    else:
        if claims:
            fail(where, "the Deployment shapes take no PersistentVolumeClaim")
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        if env.get("DELAYD_STORE__KIND") != "broker":
            fail(where, "the Deployment shapes need the broker-kept store")

    selector = w["spec"]["selector"]["matchLabels"]
    pod_labels = w["spec"]["template"]["metadata"]["labels"]
    if any(pod_labels.get(k) != v for k, v in selector.items()):
        fail(path, "the selector does not match the pod labels")
    pdbs = kinds.get("PodDisruptionBudget", [])
    if not any(p["spec"]["selector"]["matchLabels"] == selector for p in pdbs):
        fail(path, "no PodDisruptionBudget selects the pods")
    monitors = kinds.get("ServiceMonitor", [])
    if not monitors:
        fail(path, "no ServiceMonitor")
    for m in monitors:
        want = m["spec"]["selector"]["matchLabels"]
        services = [
            s for s in kinds.get("Service", [])
            if all(s["metadata"]["labels"].get(k) == v for k, v in want.items())
        ]
        ports = [p["name"] for s in services for p in s["spec"]["ports"]]
        if len(services) != 1 or m["spec"]["endpoints"][0]["port"] not in ports:
            fail(path, f"ServiceMonitor {m['metadata']['name']} selects {len(services)} services with ports {ports}")
        for s in services:
            if any(s["spec"]["selector"].get(k) != v for k, v in s["spec"]["selector"].items() if k in pod_labels and pod_labels[k] != v):
                fail(path, "the admin Service does not select the pods")
    shape = "sidecar" if sidecar else ("statefulset" if w["kind"] == "StatefulSet" else "standalone")
    print(f"{path}: {shape}: {len(docs)} objects valid for Kubernetes {', '.join(versions)}")


def main():
    if len(sys.argv) < 4:
        raise SystemExit(__doc__)
    crd = crd_schema(sys.argv[1])
    versions = sys.argv[2].split(",")
    for path in sys.argv[3:]:
        check_file(path, crd, versions)


if __name__ == "__main__":
    main()
