"""Offline checks of the Kubernetes manifests under ``deploy/``.

``pushkv check-deploy [DIR]`` (or ``python -m tools.check_deploy``) prints every problem
and exits 1 if there is one:

- every file parses, every document has apiVersion, kind, metadata.name and the namespace;
- each resource validates against the Kubernetes OpenAPI schema of ``K8S_VERSIONS``
  (``kubernetes-validate``, strict: unknown fields are errors), when it is installed;
- every Service selects the pods of some workload in ``deploy/`` and its targetPorts are
  ports those pods' containers declare; a StatefulSet's serviceName is a headless Service;
- a workload's selector matches its pod template's labels;
- every Secret / ConfigMap a pod names (env, volumes) exists in ``deploy/`` with that key;
- every volumeMount names a volume of its pod; every ``$(VAR)`` in a container's command or
  args is one of its env vars (Kubernetes leaves an unknown one as literal text);
- every Service a container's args reach by name (``host:port``) exists with that port;
- no command line carries a Secret's value (a ``$(VAR)`` from a ``secretKeyRef`` other than a user
  name): it would show in ``ps`` and in the expanded pod spec; read it from the environment or a file;
- a ``pushkv up`` pod's terminationGracePeriodSeconds covers its stop: preStop, --shutdown-timeout, --stop-timeout;
- every pushkv container has readiness and liveness probes, and every probe's port is one of its
  container's ports; every PersistentVolumeClaim a pod mounts is in ``deploy/``; ``HF_HOME`` lies
  on a mounted volume;
- every file a pushkv container reads from a Secret volume is readable by the user it runs as (the image's
  ``USER`` unless the pod says otherwise: kubelet writes Secret files as root, so a non-root user reads one
  only through the others' bits or the pod's ``fsGroup``), and the CURVE secret (``--secret-file``) is not
  readable by every user, which ``pushkv up`` refuses;
- every ServiceMonitor (Prometheus Operator) selects a Service here and scrapes a port it names;
- deploy/Dockerfile builds on a CUDA base with the CUDA torch;
- kustomization.yaml lists every manifest but the Secret template and the operator's kinds
  (``servicemonitor.yaml``, applied only where its CRDs are), and nothing else.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Any, Iterable, Optional

import yaml

K8S_VERSIONS = ("1.31.0", "1.37.0")  # the oldest supported here and the newest bundled schema
NAMESPACE = "pushkv"
SECRET_TEMPLATE = "secrets.template.yaml"
KUSTOMIZATION = "kustomization.yaml"
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "Job"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume", "StorageClass"}
VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
# kinds a cluster has only with an operator's CRDs: no bundled schema, checked structurally here,
# and their files left out of kustomization.yaml
OPERATOR_KINDS = {"ServiceMonitor": "monitoring.coreos.com/v1"}
SECRET_KEYS_ARGS_MAY_HOLD = {"username"}  # a name is no credential; a password, key or token is
STOP_TIMEOUT_S = 10.0  # pushkv up's --stop-timeout default (pushkv/supervisor/supervisor.py)

Doc = dict[str, Any]


def load(deploy_dir: str) -> tuple[list[tuple[str, Doc]], list[str]]:
    """Every document of every ``*.yaml`` file (kustomization apart), and parse problems."""
    docs: list[tuple[str, Doc]] = []
    problems: list[str] = []
    for name in sorted(os.listdir(deploy_dir)):
        if not name.endswith((".yaml", ".yml")) or name == KUSTOMIZATION:
            continue
        try:
            with open(os.path.join(deploy_dir, name)) as f:
                for doc in yaml.safe_load_all(f):
                    if doc is not None:
                        docs.append((name, doc))
        except yaml.YAMLError as e:
            problems.append(f"{name}: does not parse: {e}")
    return docs, problems


def _pod_spec(doc: Doc) -> Optional[Doc]:
    if doc.get("kind") in WORKLOADS:
        return ((doc.get("spec") or {}).get("template") or {}).get("spec")
    if doc.get("kind") == "Pod":
        return doc.get("spec")
    return None


def _pod_labels(doc: Doc) -> dict:
    return ((((doc.get("spec") or {}).get("template") or {}).get("metadata") or {}).get("labels")) or {}


def _containers(spec: Doc) -> list[Doc]:
    return list(spec.get("initContainers") or []) + list(spec.get("containers") or [])


def _where(name: str, doc: Doc) -> str:
    return f"{name}: {doc.get('kind')}/{(doc.get('metadata') or {}).get('name')}"


def structural_problems(docs: list[tuple[str, Doc]]) -> list[str]:
    out: list[str] = []
    by_kind: dict[str, dict[str, Doc]] = {}
    for fname, doc in docs:
        meta = doc.get("metadata") or {}
        if not doc.get("apiVersion") or not doc.get("kind") or not meta.get("name"):
            out.append(f"{fname}: a document without apiVersion, kind or metadata.name")
            continue
        if doc["kind"] not in CLUSTER_SCOPED and meta.get("namespace") != NAMESPACE:
            out.append(f"{_where(fname, doc)}: namespace {meta.get('namespace')!r}, expected {NAMESPACE!r}")
        by_kind.setdefault(doc["kind"], {})[meta["name"]] = doc
    secrets = {n: set((d.get("stringData") or {}) | (d.get("data") or {}))
               for n, d in by_kind.get("Secret", {}).items()}
    configmaps = {n: set(d.get("data") or {}) for n, d in by_kind.get("ConfigMap", {}).items()}
    services = by_kind.get("Service", {})
    workloads = [(f, d) for f, d in docs if _pod_spec(d) is not None]

    def ref(where: str, kind: str, store: dict[str, set], name: str, key: Optional[str]) -> None:
        if name not in store:
            out.append(f"{where}: {kind} {name!r} is not in deploy/")
        elif key is not None and key not in store[name]:
            out.append(f"{where}: {kind} {name!r} has no key {key!r}")

    for fname, doc in workloads:
        where = _where(fname, doc)
        spec = _pod_spec(doc)
        labels = _pod_labels(doc)
        sel = ((doc.get("spec") or {}).get("selector") or {}).get("matchLabels")
        if doc["kind"] != "Job" and (not sel or any(labels.get(k) != v for k, v in sel.items())):
            out.append(f"{where}: selector {sel} does not match its pod labels {labels}")
        volumes = {v["name"]: v for v in spec.get("volumes") or []}
        claims = {c["metadata"]["name"] for c in (doc.get("spec") or {}).get("volumeClaimTemplates") or []}
        for v in volumes.values():
            claim = (v.get("persistentVolumeClaim") or {}).get("claimName")
            if claim is not None and claim not in by_kind.get("PersistentVolumeClaim", {}):
                out.append(f"{where}: PersistentVolumeClaim {claim!r} is not in deploy/")
            if "secret" in v:
                for item in v["secret"].get("items") or [{"key": None}]:
                    ref(where, "Secret", secrets, v["secret"].get("secretName", ""), item["key"])
            if "configMap" in v:
                for item in v["configMap"].get("items") or [{"key": None}]:
                    ref(where, "ConfigMap", configmaps, v["configMap"].get("name", ""), item["key"])
        if doc["kind"] == "StatefulSet":
            svc = services.get((doc.get("spec") or {}).get("serviceName", ""))
            if svc is None or (svc.get("spec") or {}).get("clusterIP") != "None":
                out.append(f"{where}: serviceName is not a headless Service in deploy/")
        for c in _containers(spec):
            cw = f"{where} container {c.get('name')}"
            env = set()
            from_secret: dict[str, tuple[str, str]] = {}
            for e in c.get("env") or []:
                env.add(e["name"])
                vf = e.get("valueFrom") or {}
                if "secretKeyRef" in vf:
                    sk = vf["secretKeyRef"]
                    from_secret[e["name"]] = (sk["name"], sk["key"])
                    if not sk.get("optional"):
                        ref(cw, "Secret", secrets, sk["name"], sk["key"])
                if "configMapKeyRef" in vf:
                    ref(cw, "ConfigMap", configmaps, vf["configMapKeyRef"]["name"], vf["configMapKeyRef"]["key"])
            for src in c.get("envFrom") or []:
                if "secretRef" in src:
                    ref(cw, "Secret", secrets, src["secretRef"]["name"], None)
                if "configMapRef" in src:
                    ref(cw, "ConfigMap", configmaps, src["configMapRef"]["name"], None)
            for m in c.get("volumeMounts") or []:
                if m["name"] not in volumes and m["name"] not in claims:
                    out.append(f"{cw}: volumeMount {m['name']!r} names no volume of the pod")
            out += _container_problems(cw, c, doc["kind"])
            out += _grace_problems(cw, c, spec)
            words = [str(w) for w in (c.get("command") or []) + (c.get("args") or [])]
            for w in words:
                for var in VAR_REF.findall(w):
                    if var not in env:
                        out.append(f"{cw}: $({var}) in its command line is not one of its env vars")
                    elif var in from_secret and from_secret[var][1] not in SECRET_KEYS_ARGS_MAY_HOLD:
                        out.append(f"{cw}: $({var}) puts Secret {from_secret[var][0]!r} key {from_secret[var][1]!r} "
                                   "on its command line (ps and the pod's expanded spec show it); read it from the "
                                   "environment or a mounted file")
                for host, port in re.findall(r"(?:^|[@/])([a-z][a-z0-9-]*):(\d+)(?:$|[/?])", w):
                    svc = services.get(host)
                    if svc is None:
                        out.append(f"{cw}: {host}:{port} names no Service in deploy/")
                    elif int(port) not in {p.get("port") for p in (svc.get("spec") or {}).get("ports") or []}:
                        out.append(f"{cw}: Service {host} has no port {port}")

    for mname, mon in by_kind.get("ServiceMonitor", {}).items():
        where = f"ServiceMonitor/{mname}"
        want = ((mon.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
        scraped = [one for one in services.values()
                   if want and all(((one.get("metadata") or {}).get("labels") or {}).get(k) == v
                                   for k, v in want.items())]
        if not scraped:
            out.append(f"{where}: selector {want} matches no Service's labels in deploy/")
        for ep in (mon.get("spec") or {}).get("endpoints") or []:
            for one in scraped:
                if ep.get("port") not in {p.get("name") for p in (one.get("spec") or {}).get("ports") or []}:
                    out.append(f"{where}: endpoint port {ep.get('port')!r} is not a named port of "
                               f"Service/{one['metadata']['name']}")

    for sname, svc in services.items():
        where = f"Service/{sname}"
        sel = (svc.get("spec") or {}).get("selector") or {}
        hits = [(f, d) for f, d in workloads if sel and all(_pod_labels(d).get(k) == v for k, v in sel.items())]
        if not hits:
            out.append(f"{where}: selector {sel} matches no pod template in deploy/")
            continue
        for p in (svc.get("spec") or {}).get("ports") or []:
            target = p.get("targetPort", p.get("port"))
            for f, d in hits:
                ports = [cp for c in _pod_spec(d).get("containers") or [] for cp in c.get("ports") or []]
                names = {cp.get("name") for cp in ports}
                numbers = {cp.get("containerPort") for cp in ports}
                if target not in (names if isinstance(target, str) else numbers):
                    out.append(f"{where}: targetPort {target!r} is not a container port of {_where(f, d)}")
    return out


def _container_problems(cw: str, c: Doc, kind: str) -> list[str]:
    """Probes (present on pushkv's long-running containers, on a port the container has) and HF_HOME."""
    out: list[str] = []
    ports = c.get("ports") or []
    names, numbers = {p.get("name") for p in ports}, {p.get("containerPort") for p in ports}
    serves = c.get("command") == ["pushkv"] and (c.get("args") or [None])[0] == "up" and kind != "Job"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        spec = c.get(probe)
        if spec is None:
            if serves and probe != "startupProbe":
                out.append(f"{cw}: no {probe}")
            continue
        port = (spec.get("httpGet") or spec.get("tcpSocket") or {}).get("port")
        if port is not None and port not in (names if isinstance(port, str) else numbers):
            out.append(f"{cw}: {probe} port {port!r} is not one of its container ports")
    home = next((e.get("value") for e in c.get("env") or [] if e["name"] == "HF_HOME"), None)
    mounts = [m.get("mountPath", "") for m in c.get("volumeMounts") or []]
    if home and not any(home == m or home.startswith(m.rstrip("/") + "/") for m in mounts):
        out.append(f"{cw}: HF_HOME {home} is on no mounted volume (the checkpoint would not be there)")
    return out


def _flag(args: list, name: str, default: float) -> float:
    """A number flag of a command line (``--flag N`` or ``--flag=N``); ``default`` where absent or not a number."""
    for i, a in enumerate(args):
        a = str(a)
        value = args[i + 1] if a == name and i + 1 < len(args) else (a.split("=", 1)[1] if a.startswith(name + "=")
                                                                      else None)
        if value is not None:
            try:
                return float(value)
            except ValueError:
                return default
    return default


def _grace_problems(cw: str, c: Doc, pod: Doc) -> list[str]:
    """A ``pushkv up`` container's pod gives its stop time: its preStop sleep, then --shutdown-timeout's drain (the
    router's, or a P or D host's requests in flight), then --stop-timeout's (10 s) for the processes to exit. A
    shorter terminationGracePeriodSeconds (30 s where unset) has the kubelet SIGKILL the pod mid-drain, cutting the
    requests the drain was for."""
    args = c.get("args") or []
    if c.get("command") != ["pushkv"] or not args or args[0] != "up":
        return []
    pre = ((c.get("lifecycle") or {}).get("preStop") or {}).get("sleep", {}).get("seconds", 0)
    need = float(pre) + _flag(args, "--shutdown-timeout", 0.0) + _flag(args, "--stop-timeout", STOP_TIMEOUT_S)
    grace = pod.get("terminationGracePeriodSeconds", 30)
    if grace < need:
        return [f"{cw}: terminationGracePeriodSeconds {grace} is shorter than its stop ({pre} s preStop + "
                f"--shutdown-timeout {_flag(args, '--shutdown-timeout', 0.0):g} s + --stop-timeout "
                f"{_flag(args, '--stop-timeout', STOP_TIMEOUT_S):g} s): the kubelet would kill it mid-drain"]
    return []


def _operator_only(deploy_dir: str, name: str) -> bool:
    """Every document of the file is a kind only an operator's CRDs define."""
    with open(os.path.join(deploy_dir, name)) as f:
        try:
            docs = [d for d in yaml.safe_load_all(f) if d is not None]
        except yaml.YAMLError:
            return False
    return bool(docs) and all(OPERATOR_KINDS.get(d.get("kind")) == d.get("apiVersion") for d in docs)


def kustomization_problems(deploy_dir: str) -> list[str]:
    path = os.path.join(deploy_dir, KUSTOMIZATION)
    if not os.path.exists(path):
        return [f"{KUSTOMIZATION} is missing"]
    with open(path) as f:
        listed = set((yaml.safe_load(f) or {}).get("resources") or [])
    files = {n for n in os.listdir(deploy_dir) if n.endswith((".yaml", ".yml"))} - {KUSTOMIZATION, SECRET_TEMPLATE}
    operator = {n for n in files if _operator_only(deploy_dir, n)}
    out = [f"{KUSTOMIZATION}: {n} is not a file in deploy/" for n in sorted(listed - files)]
    out += [f"{KUSTOMIZATION}: {n} is not listed" for n in sorted(files - listed - operator)]
    out += [f"{KUSTOMIZATION}: lists {n}, whose kinds exist only with an operator's CRDs (apply it apart)"
            for n in sorted(listed & operator)]
    if SECRET_TEMPLATE in listed:
        out.append(f"{KUSTOMIZATION}: lists {SECRET_TEMPLATE} (its placeholders would be applied)")
    return out


def schema_problems(docs: Iterable[tuple[str, Doc]], versions: Iterable[str] = K8S_VERSIONS) -> list[str]:
    """Against the bundled OpenAPI schemas (kubernetes-validate works offline)."""
    import kubernetes_validate as kv

    out: list[str] = []
    for fname, doc in docs:
        if doc.get("kind") in OPERATOR_KINDS:  # no bundled schema: structural_problems checks it
            if OPERATOR_KINDS[doc["kind"]] != doc.get("apiVersion"):
                out.append(f"{_where(fname, doc)}: apiVersion {doc.get('apiVersion')!r}, expected "
                           f"{OPERATOR_KINDS[doc['kind']]!r}")
            continue
        for v in versions:
            try:
                kv.validate(doc, v, strict=True)
            except kv.ValidationError as e:
                path = "/".join(str(p) for p in e.path)
                out.append(f"{_where(fname, doc)}: invalid for Kubernetes {v} at {path or '.'}: {e.message}")
            except (kv.SchemaNotFoundError, kv.InvalidSchemaError) as e:
                out.append(f"{_where(fname, doc)}: no schema for Kubernetes {v}: {e}")
    return out


def dockerfile_problems(deploy_dir: str) -> list[str]:
    """The image the manifests run: a CUDA base, and tools/install.sh with the CUDA torch."""
    path = os.path.join(deploy_dir, "Dockerfile")
    if not os.path.exists(path):
        return ["Dockerfile is missing (the image every pod runs)"]
    with open(path) as f:
        lines = [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]
    out = []
    base = next((line for line in lines if line.upper().startswith("FROM ")), "")
    if not base.split()[1:2] or not base.split()[1].startswith("nvidia/cuda:"):
        out.append(f"Dockerfile: {base or 'no FROM'} is not a CUDA base (nvidia/cuda:...)")
    if not any("PUSHKV_TORCH=cuda" in line and "tools/install.sh" in line for line in lines):
        out.append("Dockerfile: installs no CUDA torch (PUSHKV_TORCH=cuda bash tools/install.sh)")
    return out


def image_user(deploy_dir: str) -> int:
    """The uid deploy/Dockerfile's last ``USER`` runs the image as (0 without one; a name other than root: 65534)."""
    path = os.path.join(deploy_dir, "Dockerfile")
    uid = 0
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                words = line.split()
                if len(words) >= 2 and words[0].upper() == "USER":
                    name = words[1].split(":")[0]
                    uid = int(name) if name.isdigit() else (0 if name == "root" else 65534)
    return uid


def _is_pushkv_image(image: str) -> bool:
    return image.rsplit("/", 1)[-1].split(":")[0] == "pushkv"


def secret_access_problems(docs: list[tuple[str, Doc]], image_uid: int) -> list[str]:
    """Each Secret file a pushkv container mounts, as kubelet writes it (owner root; with the pod's fsGroup, that
    group and mode | 0440): readable by the container's user, and the one ``--secret-file`` names not open to
    every user (``pushkv up`` refuses that)."""
    out: list[str] = []
    for fname, doc in docs:
        spec = _pod_spec(doc)
        if spec is None:
            continue
        pod_sc = spec.get("securityContext") or {}
        volumes = {v["name"]: v for v in spec.get("volumes") or []}
        for c in _containers(spec):
            if not _is_pushkv_image(str(c.get("image", ""))):
                continue
            cw = f"{_where(fname, doc)} container {c.get('name')}"
            sc = c.get("securityContext") or {}
            uid = sc.get("runAsUser", pod_sc.get("runAsUser", image_uid))
            gid = sc.get("runAsGroup", pod_sc.get("runAsGroup"))
            fs_group = pod_sc.get("fsGroup")
            groups = {g for g in (gid, fs_group, *(pod_sc.get("supplementalGroups") or [])) if g is not None}
            args = [str(w) for w in c.get("args") or []]
            secret_file = args[args.index("--secret-file") + 1] if "--secret-file" in args[:-1] else None
            for m in c.get("volumeMounts") or []:
                vol = (volumes.get(m["name"]) or {}).get("secret")
                if vol is None:
                    continue
                default = vol.get("defaultMode", 0o644)
                items = vol.get("items") or [{"key": None, "path": None}]
                for item in items:
                    mode = item.get("mode", default)
                    group = 0
                    if fs_group is not None:
                        mode, group = mode | 0o440, fs_group
                    path = os.path.join(m["mountPath"], item.get("path") or "*")
                    readable = uid == 0 or mode & 0o004 or (mode & 0o040 and group in groups)
                    if not readable:
                        out.append(f"{cw}: runs as uid {uid}, which cannot read {path} (Secret "
                                   f"{vol.get('secretName')!r}, mode {mode:04o}, owned by root): give the pod "
                                   "securityContext.fsGroup (kubelet then makes the file that group's, mode | 0440)")
                    if secret_file is not None and path == secret_file and mode & 0o007:
                        out.append(f"{cw}: --secret-file {path} has mode {mode:04o} (every user may read it): "
                                   "pushkv up refuses it; give the Secret volume defaultMode 0400 or 0440")
    return out


def check(deploy_dir: str, schemas: bool = True) -> list[str]:
    docs, out = load(deploy_dir)
    out += structural_problems(docs)
    out += secret_access_problems(docs, image_user(deploy_dir))
    out += kustomization_problems(deploy_dir)
    out += dockerfile_problems(deploy_dir)
    if schemas:
        out += schema_problems(docs)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="pushkv check-deploy", description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", nargs="?", default=os.path.join(os.path.dirname(os.path.dirname(__file__)), "deploy"))
    ap.add_argument("--no-schemas", action="store_true", help="structural checks only (no kubernetes-validate)")
    args = ap.parse_args(argv)
    problems = check(args.dir, schemas=not args.no_schemas)
    for p in problems:
        print(p)
    print(f"{args.dir}: {len(problems)} problem(s)", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
