"""The start watchdog's API calls: each request is built by a pure function (the tests read them word for word),
and `Api` sends them with the pod's ServiceAccount. Standard library only.

    from elastic_mnist.ops.kubeapi import list_request; print(list_request("elastic-mnist", "app=x").path)
"""

from __future__ import annotations

import json
import os
import ssl
import urllib.parse
import urllib.request
from dataclasses import dataclass

from elastic_mnist.ops.startrules import format_time

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
HEARTBEAT = "elastic-mnist.io/watchdog-heartbeat"  # the Job's annotation: the watchdog's last complete pass


@dataclass(frozen=True)
class Request:
    """One API call."""
    method: str
    path: str
    body: dict | None = None
    content_type: str = "application/json"


def list_request(namespace: str, selector: str) -> Request:
    return Request("GET", f"/api/v1/namespaces/{namespace}/pods?{urllib.parse.urlencode({'labelSelector': selector})}")


def events_request(namespace: str) -> Request:
    query = urllib.parse.urlencode({"fieldSelector": "involvedObject.kind=Pod,reason=FailedMount"})
    return Request("GET", f"/api/v1/namespaces/{namespace}/events?{query}")


def nodes_request(label: str = "") -> Request:
    """The nodes carrying `label` (the marks), or with "" every node (read only when a decision needs them)."""
    return Request("GET", f"/api/v1/nodes?{urllib.parse.urlencode({'labelSelector': label})}" if label else
                   "/api/v1/nodes")


def label_request(node: str, label: str, value: str | None) -> Request:
    """Set (or with None remove) one label of a node: a JSON merge patch touches nothing else."""
    return Request("PATCH", f"/api/v1/nodes/{node}", {"metadata": {"labels": {label: value}}},
                   "application/merge-patch+json")


def status_patch(pod: dict, condition: dict, phase: str | None = None) -> Request:
    """A strategic merge patch of pods/status: conditions merge by type, so the others stay. The uid in the
    patch makes it fail on a pod that was replaced under the same name (uid is immutable). With `phase` the
    pod is also made terminal, as the pod garbage collector does for a pod its node will never end."""
    meta = pod["metadata"]
    status = {"conditions": [condition], **({"phase": phase} if phase else {})}
    return Request("PATCH", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status",
                   {"metadata": {"uid": meta["uid"]}, "status": status}, "application/strategic-merge-patch+json")


def delete_request(pod: dict, force: bool = False) -> Request:
    """Delete exactly this pod (uid precondition), never a replacement of the same name; `force` with a grace
    period of 0, so that the API server removes it without its kubelet's confirmation (once the Job controller
    has taken its finalizer off)."""
    meta = pod["metadata"]
    body = {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": {"uid": meta["uid"]},
            **({"gracePeriodSeconds": 0} if force else {})}
    return Request("DELETE", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}", body)


def heartbeat_request(namespace: str, job: str, now: float) -> Request:
    """The time of this pass on the Job's annotation: a watchdog that stopped working is seen there (and by
    `kubectl get job -o yaml`), whatever its pod's state. A merge patch of one annotation: `kubectl apply` of the
    Job keeps it and changes nothing else."""
    return Request("PATCH", f"/apis/batch/v1/namespaces/{namespace}/jobs/{job}",
                   {"metadata": {"annotations": {HEARTBEAT: format_time(now)}}}, "application/merge-patch+json")


class Api:
    """The API server with the pod's ServiceAccount; the token is re-read per call (it is rotated)."""

    def __init__(self, base: str, sa_dir: str = SA_DIR, timeout: float = 30.0):
        self.base, self.sa_dir, self.timeout = base, sa_dir, timeout
        self.tls = ssl.create_default_context(cafile=os.path.join(sa_dir, "ca.crt"))

    def send(self, req: Request) -> dict:
        with open(os.path.join(self.sa_dir, "token")) as f:
            token = f.read().strip()
        data = json.dumps(req.body).encode() if req.body is not None else None
        http = urllib.request.Request(self.base + req.path, data=data, method=req.method, headers={
            "Authorization": f"Bearer {token}", "Content-Type": req.content_type, "Accept": "application/json"})
        with urllib.request.urlopen(http, timeout=self.timeout, context=self.tls) as resp:
            return json.loads(resp.read() or b"{}")

    @classmethod
    def in_cluster(cls) -> Api:
        """The API server the kubelet names in every pod's environment (the `kubernetes` Service)."""
        host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        return cls(f"https://{'[' + host + ']' if ':' in host else host}:{port}")
