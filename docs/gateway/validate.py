"""Checks the manifests of docs/gateway: the Kubernetes resources against the official
schemas (kubernetes-validate, strict), the extension's resources for the fields and
types its v1 API requires, and that the pool selects the Deployment's pods on its port.

    python docs/gateway/validate.py
"""
import pathlib
import subprocess
import sys

import yaml

here = pathlib.Path(__file__).parent
docs = {d["kind"]: d for f in ["mmserve.yaml", "inferencepool.yaml"] for d in yaml.safe_load_all((here / f).read_text())}
subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "--quiet", str(here / "mmserve.yaml")],
               check=True)

pool, route, deploy = docs["InferencePool"], docs["HTTPRoute"], docs["Deployment"]
assert pool["apiVersion"] == "inference.networking.k8s.io/v1", pool["apiVersion"]
spec = pool["spec"]
assert set(spec) <= {"selector", "targetPorts", "endpointPickerRef"}, spec.keys()
labels = spec["selector"]["matchLabels"]
assert labels.items() <= deploy["spec"]["template"]["metadata"]["labels"].items(), "the pool selects the pods"
ports = [p["containerPort"] for c in deploy["spec"]["template"]["spec"]["containers"] for p in c["ports"]]
assert [p["number"] for p in spec["targetPorts"]] == ports[:1], (spec["targetPorts"], ports)
epp = spec["endpointPickerRef"]
assert isinstance(epp["name"], str) and isinstance(epp["port"]["number"], int), epp
assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
ref = route["spec"]["rules"][0]["backendRefs"][0]
assert (ref["group"], ref["kind"], ref["name"]) == ("inference.networking.k8s.io", "InferencePool", pool["metadata"]["name"])
for probe in ["readinessProbe", "livenessProbe"]:
    assert deploy["spec"]["template"]["spec"]["containers"][0][probe]["httpGet"]["path"] == "/health"
print("gateway manifests: valid")
