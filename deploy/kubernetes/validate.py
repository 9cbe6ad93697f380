"""Offline checks of deploy/kubernetes/ (run by deploy/check.sh in its venv).

1. The files and kustomization.yaml agree: every manifest is listed, every
   listed file exists.
2. Every built-in resource validates, strictly (unknown fields are errors),
   against the Kubernetes JSON schemas bundled in kubernetes-validate, for
   each version given. A kind or apiVersion without a schema is an error,
   not kubernetes-validate's warning: a typo in apiVersion would otherwise
   pass unchecked.
3. ServiceMonitor and PrometheusRule are Prometheus Operator CRDs, for which
   kubernetes-validate bundles no schema: they are checked here by what the
   deployment relies on instead (see check_wiring and check_rules).
4. The objects fit together: selectors match the pod template's labels, the
   ServiceMonitor scrapes the Service's port, the `slot` label comes from the
   label CDC_RELAY_SLOT reads.
5. The PrometheusRule's groups equal deploy/prometheus/alerts.yml, parsed.
6. The Deployment's replicas and the PodDisruptionBudget fit the sharding
   in the ConfigMap: the pods that stream (shards / max-shards, rounded up;
   1 unsharded) are the PDB's minAvailable, and replicas leave at least one
   spare.

Usage: validate.py KUBERNETES_VERSION...   (exit 1 on any failure)
"""

import pathlib
import sys

import kubernetes_validate.utils as kv
import yaml

HERE = pathlib.Path(__file__).resolve().parent
ALERTS = HERE.parent / "prometheus" / "alerts.yml"
CRDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("monitoring.coreos.com/v1", "PrometheusRule")}

failures = []


def fail(msg):
    failures.append(msg)
    print(f"   FAIL {msg}")


def load_resources():
    kustomization = yaml.safe_load((HERE / "kustomization.yaml").read_text())
    listed = kustomization.get("resources", [])
    on_disk = sorted(p.name for p in HERE.glob("*.yaml") if p.name != "kustomization.yaml")
    for name in sorted(set(on_disk) - set(listed)):
        fail(f"{name} is not in kustomization.yaml's resources")
    for name in sorted(set(listed) - set(on_disk)):
        fail(f"kustomization.yaml lists {name}, which does not exist")
    resources = []
    for name in listed:
        path = HERE / name
        if path.exists():
            for doc in yaml.safe_load_all(path.read_text()):
                if doc:
                    resources.append((name, doc))
    return resources


def check_schemas(resources, versions):
    for name, r in resources:
        what = f"{name}: {r.get('kind')}/{r.get('metadata', {}).get('name')}"
        if (r.get("apiVersion"), r.get("kind")) in CRDS:
            print(f"   {what}: a Prometheus Operator CRD, no bundled schema (checked below)")
            continue
        before = len(failures)
        for v in versions:
            try:
                kv.validate(r, v, strict=True)
            except kv.ValidationError as e:
                path = ".".join(str(p) for p in e.path)
                fail(f"{what} against Kubernetes {v}: {path}: {e.message}")
            except kv.SchemaNotFoundError as e:
                fail(f"{what}: {e.message}")
        if len(failures) == before:
            print(f"   {what}: valid against Kubernetes {', '.join(versions)} (strict)")


def one(resources, kind):
    found = [r for _, r in resources if r.get("kind") == kind]
    if len(found) != 1:
        fail(f"expected exactly one {kind}, found {len(found)}")
        return {}
    return found[0]


def matches(selector, labels):
    return all(labels.get(k) == v for k, v in selector.items())


def check_wiring(resources):
    deploy = one(resources, "Deployment")
    service = one(resources, "Service")
    pdb = one(resources, "PodDisruptionBudget")
    monitor = one(resources, "ServiceMonitor")
    if not (deploy and service and pdb and monitor):
        return
    pod = deploy["spec"]["template"]
    labels = pod["metadata"]["labels"]
    for what, selector in [
        ("Deployment selector", deploy["spec"]["selector"]["matchLabels"]),
        ("PodDisruptionBudget selector", pdb["spec"]["selector"]["matchLabels"]),
        ("Service selector", service["spec"]["selector"]),
    ]:
        if not matches(selector, labels):
            fail(f"{what} {selector} does not select the pod template's labels {labels}")
    if not matches(monitor["spec"]["selector"]["matchLabels"], service["metadata"].get("labels", {})):
        fail("the ServiceMonitor's selector does not select the Service")
    service_ports = {p["name"] for p in service["spec"]["ports"]}
    container = pod["spec"]["containers"][0]
    container_ports = {p["name"] for p in container.get("ports", [])}
    for p in service["spec"]["ports"]:
        if p["targetPort"] not in container_ports:
            fail(f"Service port {p['name']} targets {p['targetPort']!r}, not a container port {sorted(container_ports)}")
    for probe in ("livenessProbe", "readinessProbe"):
        port = container.get(probe, {}).get("httpGet", {}).get("port")
        if port not in container_ports:
            fail(f"{probe} uses port {port!r}, not a container port {sorted(container_ports)}")
    endpoints = monitor["spec"].get("endpoints", [])
    if not endpoints:
        fail("the ServiceMonitor has no endpoints")
    env = {e["name"]: e for e in container.get("env", [])}
    slot_ref = env.get("CDC_RELAY_SLOT", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath", "")
    for ep in endpoints:
        if ep.get("port") not in service_ports:
            fail(f"ServiceMonitor endpoint port {ep.get('port')!r} is not a Service port {sorted(service_ports)}")
        targets = {r.get("targetLabel"): r for r in ep.get("relabelings", [])}
        if targets.get("job", {}).get("replacement") != "cdc-relay":
            fail('the ServiceMonitor does not set job="cdc-relay", which the alert rules select')
        slot_source = targets.get("slot", {}).get("sourceLabels", [])
        # A pod label key becomes __meta_kubernetes_pod_label_<key, non-alphanumerics as _>.
        want = [
            "__meta_kubernetes_pod_label_" + "".join(c if c.isalnum() else "_" for c in key)
            for key in labels
            if slot_ref == f"metadata.labels['{key}']"
        ]
        if not want or slot_source != want:
            fail(f"the ServiceMonitor's `slot` label comes from {slot_source}, not from the pod label CDC_RELAY_SLOT reads ({slot_ref or 'none'})")


def check_rules(resources):
    rule = one(resources, "PrometheusRule")
    if not rule:
        return
    alerts = yaml.safe_load(ALERTS.read_text())
    if rule.get("spec") != alerts:
        fail("the PrometheusRule's spec differs from deploy/prometheus/alerts.yml: run deploy/kubernetes/gen-prometheusrule.sh")
    else:
        n = sum(len(g["rules"]) for g in alerts["groups"])
        print(f"   PrometheusRule: the same {n} rules as deploy/prometheus/alerts.yml")


def setting(deploy, configmap, name):
    """A CDC_RELAY_* value as the relay sees it: the container's env, else the ConfigMap's."""
    container = deploy["spec"]["template"]["spec"]["containers"][0]
    for e in container.get("env", []):
        if e["name"] == name:
            return e.get("value")
    return (configmap.get("data") or {}).get(name)


def check_sharding(resources):
    deploy = one(resources, "Deployment")
    pdb = one(resources, "PodDisruptionBudget")
    configmap = one(resources, "ConfigMap")
    if not (deploy and pdb and configmap):
        return
    shards = setting(deploy, configmap, "CDC_RELAY_SHARDS")
    max_shards = setting(deploy, configmap, "CDC_RELAY_MAX_SHARDS") or "1"
    try:
        shards = int(shards) if shards else None
        max_shards = int(max_shards)
    except ValueError:
        fail(f"CDC_RELAY_SHARDS {shards!r} or CDC_RELAY_MAX_SHARDS {max_shards!r} is not a number")
        return
    if shards is None and max_shards > 1:
        fail("CDC_RELAY_MAX_SHARDS is set without CDC_RELAY_SHARDS (the relay refuses that, exit 2)")
        return
    holders = 1 if shards is None else -(-shards // min(max_shards, shards))
    replicas = deploy["spec"].get("replicas", 1)
    min_available = pdb["spec"].get("minAvailable")
    what = "one slot" if shards is None else f"{shards} shards, at most {max_shards} per pod"
    if min_available != holders:
        fail(f"PodDisruptionBudget minAvailable is {min_available!r}; with {what}, {holders} pod(s) stream and are Ready")
    if replicas <= holders:
        fail(f"Deployment replicas is {replicas}; with {what}, {holders} pod(s) stream: add at least one spare")
    if "CDC_RELAY_STOP_AT_LSN" in {e["name"] for e in deploy["spec"]["template"]["spec"]["containers"][0].get("env", [])} \
            or "CDC_RELAY_STOP_AT_LSN" in (configmap.get("data") or {}):
        fail("CDC_RELAY_STOP_AT_LSN is for a resharding only (docs/operations.md#resharding), not the manifests")
    print(f"   sharding: {what}: {holders} streaming pod(s) (PDB minAvailable), {replicas - holders} spare(s)")


def main():
    versions = sys.argv[1:]
    if not versions:
        sys.exit("usage: validate.py KUBERNETES_VERSION...")
    resources = load_resources()
    check_schemas(resources, versions)
    check_wiring(resources)
    check_rules(resources)
    check_sharding(resources)
    if failures:
        sys.exit(f"deploy/kubernetes: {len(failures)} problem(s)")


if __name__ == "__main__":
    main()
