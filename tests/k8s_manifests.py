"""Reading the rendered manifests the way the kubelet would: find a workload, its containers, the
environment with the downward API filled in and $(VAR) expanded, the argv it runs, the volume behind
a path. Shared by tests/test_k8s.py (static checks) and tests/e2e/test_k8s_lifecycle.py (the pod spec
run as local processes)."""

from __future__ import annotations

import re

# The labels the Job controller puts on every pod it creates (not in the template).
JOB_UID = "0c5e9a8e-7a4b-4c3e-9d52-1f0f6b7d2a11"


def find(docs: list[dict], kind: str, name: str) -> dict:
    hits = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(hits) == 1, f"expected one {kind}/{name}, found {len(hits)}"
    return hits[0]


def trainer_job(docs: list[dict]) -> dict:
    return find(docs, "Job", "trainer")


def workloads(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] in ("StatefulSet", "Deployment", "Job")]


def pod_spec(doc: dict) -> dict:
    return doc["spec"]["template"]["spec"]


def pod_labels(doc: dict) -> dict:
    return doc["spec"]["template"]["metadata"]["labels"]


def all_containers(doc: dict) -> list[dict]:
    spec = pod_spec(doc)
    return spec.get("initContainers", []) + spec["containers"]


def container(doc: dict, name: str) -> dict:
    return next(c for c in all_containers(doc) if c["name"] == name)


def selects(selector: dict, labels: dict) -> bool:
    assert "matchExpressions" not in selector, "only matchLabels selectors are used here"
    match = selector["matchLabels"] if "matchLabels" in selector else selector
    return bool(match) and all(labels.get(k) == v for k, v in match.items())


_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(value: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion: defined names are replaced, undefined ones kept, $$ escapes."""
    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return _REF.sub(sub, value)


def refs(value: str) -> set[str]:
    return {m.group(1) for m in _REF.finditer(value) if m.group(1)}


def runtime_labels(doc: dict, uid: str = JOB_UID) -> dict[str, str]:
    """The pod's labels as created: the template's plus the Job controller's."""
    labels = dict(pod_labels(doc))
    if doc["kind"] == "Job":
        labels.update({"batch.kubernetes.io/controller-uid": uid, "controller-uid": uid,
                       "batch.kubernetes.io/job-name": doc["metadata"]["name"], "job-name": doc["metadata"]["name"]})
    return labels


def resolve_env(doc: dict, c: dict, pod_name: str = "trainer-0", pod_ip: str = "10.0.0.7",
                uid: str = JOB_UID) -> dict[str, str]:
    """The container's environment as the kubelet builds it, with the downward API filled in."""
    field = {"metadata.name": lambda: pod_name, "status.podIP": lambda: pod_ip,
             "metadata.namespace": lambda: doc["metadata"]["namespace"]}
    labels = runtime_labels(doc, uid)
    env: dict[str, str] = {}
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = expand(e["value"], env)
            continue
        path = e["valueFrom"]["fieldRef"]["fieldPath"]
        label = re.fullmatch(r"metadata\.labels\['(.+)'\]", path)
        env[e["name"]] = labels[label.group(1)] if label else field[path]()
    return env


def argv(doc: dict, c: dict, **kw) -> list[str]:
    env = resolve_env(doc, c, **kw)
    return [expand(a, env) for a in c.get("command", []) + c.get("args", [])]


def flag(args: list[str], name: str) -> str:
    values = [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]
    assert len(values) == 1, f"--{name} given {len(values)} times in {args}"
    return values[0]


def under(path: str, mount: str) -> bool:
    return path == mount or path.startswith(mount.rstrip("/") + "/")


def mount_for(doc: dict, c: dict, path: str) -> tuple[dict, dict]:
    """The volumeMount holding path (the deepest one) and its volume."""
    mounts = [m for m in c.get("volumeMounts", []) if under(path, m["mountPath"])]
    assert mounts, f"{path} is on no volume of {c['name']}: it would land on the read-only root filesystem"
    m = max(mounts, key=lambda m: len(m["mountPath"]))
    volume = next(v for v in pod_spec(doc)["volumes"] if v["name"] == m["name"])
    return m, volume
