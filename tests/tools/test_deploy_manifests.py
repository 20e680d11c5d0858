"""The Kubernetes recipe under deploy/: offline checks (tools/check_deploy.py) pass on the
real manifests, and each check catches the break it is for (a table of mutations)."""
from __future__ import annotations

import copy
import json
import os
import shutil

import pytest
import yaml

from pushkv.config_flags import load_config_file
from tools import check_deploy as cd
from tests.support import ROOT

DEPLOY = os.path.join(ROOT, "deploy")
ETCD_URL = "etcd://$(ETCD_USER):$(ETCD_PASSWORD)@etcd:2379"


def _docs():
    docs, problems = cd.load(DEPLOY)
    assert problems == []
    return docs


def _find(docs, kind, name):
    return next(d for _, d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


def test_structure_and_kustomization():
    docs = _docs()
    assert cd.structural_problems(docs) == []
    assert cd.kustomization_problems(DEPLOY) == []
    kinds = {(d["kind"], d["metadata"]["name"]) for _, d in docs}
    for want in [("Namespace", "pushkv"), ("StatefulSet", "etcd"), ("Service", "etcd"), ("Job", "etcd-auth"),
                 ("Deployment", "pushkv-router"), ("Service", "pushkv-router"), ("Deployment", "pushkv-prefill"),
                 ("Deployment", "pushkv-decode"), ("Secret", "pushkv-secrets"), ("Secret", "etcd-credentials"),
                 ("ConfigMap", "pushkv-config")]:
        assert want in kinds


def test_schemas_offline():
    pytest.importorskip("kubernetes_validate")
    assert cd.schema_problems(_docs()) == []


@pytest.mark.parametrize("role", ["router", "prefill", "decode"])
def test_hosts_command_line(role):
    """The flags every host runs with, the secret file where the Secret is mounted."""
    docs = _docs()
    dep = _find(docs, "Deployment", f"pushkv-{role}")
    spec = dep["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    args = c["args"]
    flag = lambda f: args[args.index(f) + 1]  # noqa: E731
    assert c["command"] == ["pushkv"] and args[0] == "up"
    assert flag("--role") == role
    assert flag("--registry") == ETCD_URL
    assert flag("--advertise") == "$(POD_IP)"
    assert flag("--secret-file") == "/etc/pushkv/curve.secret"
    env = {e["name"]: e.get("valueFrom", {}) for e in c["env"]}
    assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    vol = next(v for v in spec["volumes"] if v["name"] == mounts["/etc/pushkv"])
    assert vol["secret"]["items"] == [{"key": "curve.secret", "path": "curve.secret"}]
    assert vol["secret"]["defaultMode"] == 0o400
    if role == "router":
        assert flag("--api-key") == "$(PUSHKV_API_KEY)"
        assert env["PUSHKV_API_KEY"]["secretKeyRef"] == {"name": "pushkv-secrets", "key": "api-key"}
    else:
        assert "--api-key" not in args
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_config_map_is_a_pushkv_config(tmp_path):
    cm = _find(_docs(), "ConfigMap", "pushkv-config")
    path = tmp_path / "deploy.json"
    path.write_text(cm["data"]["deploy.json"])
    cfg = load_config_file(str(path))  # what `pushkv up --config` reads
    assert cfg.mode == "push" and cfg.prefill.device == "cuda" and cfg.decode.device == "cuda"
    json.loads(cm["data"]["deploy.json"])


def _mutate(fname, kind, name, edit):
    def apply(docs):
        for f, d in docs:
            if f == fname and d["kind"] == kind and d["metadata"]["name"] == name:
                edit(d)
        return docs
    return apply


def _pod(d):
    return d["spec"]["template"]["spec"]


def _c(d):
    return _pod(d)["containers"][0]


BREAKS = [
    ("service selector", _mutate("router.yaml", "Service", "pushkv-router",
                                 lambda d: d["spec"]["selector"].update({"app.kubernetes.io/component": "routr"})),
     "matches no pod template"),
    ("service targetPort", _mutate("router.yaml", "Service", "pushkv-router",
                                   lambda d: d["spec"]["ports"][0].update(targetPort="web")),
     "is not a container port"),
    ("missing secret key", _mutate("router.yaml", "Deployment", "pushkv-router",
                                   lambda d: _c(d)["env"][3]["valueFrom"]["secretKeyRef"].update(key="apikey")),
     "has no key 'apikey'"),
    ("missing secret", _mutate("prefill.yaml", "Deployment", "pushkv-prefill",
                               lambda d: _pod(d)["volumes"][0]["secret"].update(secretName="curve")),
     "Secret 'curve' is not in deploy/"),
    ("missing configmap", _mutate("decode.yaml", "Deployment", "pushkv-decode",
                                  lambda d: _pod(d)["volumes"][1]["configMap"].update(name="cfg")),
     "ConfigMap 'cfg' is not in deploy/"),
    ("undefined $(VAR)", _mutate("decode.yaml", "Deployment", "pushkv-decode",
                                 lambda d: _c(d)["env"].pop(0)),
     "$(POD_IP) in its command line is not one of its env vars"),
    ("workload selector", _mutate("prefill.yaml", "Deployment", "pushkv-prefill",
                                  lambda d: d["spec"]["selector"]["matchLabels"].update({"x": "y"})),
     "does not match its pod labels"),
    ("volume mount", _mutate("router.yaml", "Deployment", "pushkv-router",
                             lambda d: _c(d)["volumeMounts"][0].update(name="secret")),
     "names no volume"),
    ("etcd service", _mutate("etcd.yaml", "Service", "etcd", lambda d: d["spec"]["ports"][0].update(port=2380)),
     "Service etcd has no port 2379"),
    ("statefulset serviceName", _mutate("etcd.yaml", "StatefulSet", "etcd",
                                        lambda d: d["spec"].update(serviceName="etcd")),
     "is not a headless Service"),
    ("namespace", _mutate("decode.yaml", "Deployment", "pushkv-decode",
                          lambda d: d["metadata"].update(namespace="default")),
     "expected 'pushkv'"),
]


@pytest.mark.parametrize("what, mutate, expect", BREAKS, ids=[b[0] for b in BREAKS])
def test_structural_checks_catch(what, mutate, expect):
    docs = mutate(copy.deepcopy(_docs()))
    problems = cd.structural_problems(docs)
    assert any(expect in p for p in problems), (what, problems)


SCHEMA_BREAKS = [
    ("unknown field", _mutate("router.yaml", "Deployment", "pushkv-router",
                              lambda d: _c(d).update(imagePullPolice="Always"))),
    ("wrong type", _mutate("prefill.yaml", "Deployment", "pushkv-prefill",
                           lambda d: d["spec"].update(replicas="two"))),
    ("wrong apiVersion", _mutate("etcd.yaml", "StatefulSet", "etcd", lambda d: d.update(apiVersion="apps/v1beta1"))),
]


@pytest.mark.parametrize("what, mutate", SCHEMA_BREAKS, ids=[b[0] for b in SCHEMA_BREAKS])
def test_schema_checks_catch(what, mutate):
    pytest.importorskip("kubernetes_validate")
    docs = [(f, d) for f, d in mutate(copy.deepcopy(_docs())) if d["kind"] in ("Deployment", "StatefulSet")]
    assert cd.schema_problems(docs) != [], what


def test_a_broken_file_fails_the_whole_check(tmp_path):
    d = tmp_path / "deploy"
    shutil.copytree(DEPLOY, d)
    assert cd.check(str(d), schemas=False) == []
    (d / "router.yaml").write_text((d / "router.yaml").read_text() + "\n  bad: [indent\n")
    (d / "extra.yaml").write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "ConfigMap",
                                                  "metadata": {"name": "x", "namespace": "pushkv"}}))
    problems = cd.check(str(d), schemas=False)
    assert any("router.yaml: does not parse" in p for p in problems)
    assert any("extra.yaml is not listed" in p for p in problems)
