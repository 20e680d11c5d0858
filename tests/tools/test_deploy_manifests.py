"""The Kubernetes recipe under deploy/: offline checks (tools/check_deploy.py) pass on the
real manifests, and each check catches the break it is for (a table of mutations)."""
from __future__ import annotations

import copy
import json
import os
import re
import shutil

import pytest
import yaml

from pushkv.config_flags import load_config_file
from pushkv.supervisor.plan import plan_deployment
from tools import check_deploy as cd
from tests.support import ROOT

DEPLOY = os.path.join(ROOT, "deploy")
ETCD_URL = "etcd://$(ETCD_USER)@etcd:2379?password_file=/etc/etcd-credentials/password"


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
                 ("ConfigMap", "pushkv-config"), ("PersistentVolumeClaim", "pushkv-models"), ("Job", "model-download"),
                 ("Service", "pushkv-instance-metrics"), ("ServiceMonitor", "pushkv"), ("Secret", "hf-token")]:
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
    # kubelet writes a Secret's files as root; the image's user (uid 10001) reads them as the pod's fsGroup
    assert vol["secret"]["defaultMode"] == 0o440
    assert spec["securityContext"]["fsGroup"] == spec["securityContext"]["runAsUser"] == cd.image_user(DEPLOY) == 10001
    # the model: the ConfigMap's repo id, resolved offline from the Hub cache on the models volume
    assert (flag("--model"), flag("--revision")) == ("$(PUSHKV_MODEL)", "$(PUSHKV_REVISION)")
    assert env["PUSHKV_MODEL"] == {"configMapKeyRef": {"name": "pushkv-config", "key": "model"}}
    plain = {e["name"]: e.get("value") for e in c["env"]}
    assert (plain["HF_HOME"], plain["HF_HUB_OFFLINE"]) == ("/models/hf", "1")
    models = next(v for v in spec["volumes"] if v["name"] == mounts["/models"])
    assert models["persistentVolumeClaim"] == {"claimName": "pushkv-models", "readOnly": True}
    # no credential on the command line: the etcd password from a file, the API key from the environment
    assert "--api-key" not in args and not any("ETCD_PASSWORD" in a for a in args)
    # a rolling update (or a P or D pod's scale-down) drains: the kubelet waits for the drain and the processes' stop
    # (--stop-timeout 10 s)
    assert float(flag("--shutdown-timeout")) > 0
    assert spec["terminationGracePeriodSeconds"] >= float(flag("--shutdown-timeout")) + 10
    if role == "router":
        assert env["PUSHKV_API_KEY"]["secretKeyRef"] == {"name": "pushkv-secrets", "key": "api-key"}
    else:
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert flag("--metrics-port") == "8001"
        # /metrics (the scheduler) is down while the supervisor restarts the instance, weights reloaded, and pushkv
        # status still exits 0: ready is /metrics, alive is the supervisor's answer (the other way round the kubelet
        # killed the pod in the middle of that restart past 60 s, and counted it ready while its instance was down)
        for probe in ("startupProbe", "readinessProbe"):
            assert c[probe]["httpGet"] == {"path": "/metrics", "port": "metrics"}
        # the startup probe waits out --load-timeout (1200 s) before liveness may restart the pod
        assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 1200
        assert c["livenessProbe"]["exec"]["command"] == ["pushkv", "status"]
        assert dep["spec"]["template"]["metadata"]["labels"]["pushkv.io/model-server"] == "true"


def test_config_map_is_a_pushkv_config(tmp_path):
    cm = _find(_docs(), "ConfigMap", "pushkv-config")
    path = tmp_path / "deploy.json"
    path.write_text(cm["data"]["deploy.json"])
    cfg = load_config_file(str(path))  # what `pushkv up --config` reads
    assert cfg.mode == "push" and cfg.prefill.device == "cuda" and cfg.decode.device == "cuda"
    # pools sized from each GPU at launch, and the plan accepts that
    assert (cfg.gpu_memory_utilization, cfg.prefill.num_blocks, cfg.decode.num_blocks) == (0.9, 0, 0)
    ports = iter(range(30000, 31000))
    plan_deployment(cfg, pick_port=lambda: next(ports), run_root=str(tmp_path))
    assert "/" in cm["data"]["model"] and cm["data"]["revision"]  # a Hub repo id, for every host alike
    json.loads(cm["data"]["deploy.json"])


def test_the_download_job_fills_the_cache_every_pod_reads():
    docs = _docs()
    job = _find(docs, "Job", "model-download")
    (c,) = job["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["hf", "download"]
    assert c["args"][:3] == ["$(PUSHKV_MODEL)", "--revision", "$(PUSHKV_REVISION)"]
    env = {e["name"]: e for e in c["env"]}
    assert env["HF_HOME"]["value"] == "/models/hf"
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token", "optional": True}
    assert job["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] == "pushkv-models"
    pvc = _find(docs, "PersistentVolumeClaim", "pushkv-models")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]  # P and D pods on several nodes mount it


def test_the_dockerfile_builds_on_cuda_with_the_cuda_torch():
    assert cd.dockerfile_problems(DEPLOY) == []
    with open(os.path.join(DEPLOY, "Dockerfile")) as f:
        assert re.search(r"^FROM nvidia/cuda:\S+-runtime", f.read(), re.M)


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


def _env(d, name):
    return next(e for e in _c(d)["env"] if e["name"] == name)


def _volume(d, name):
    return next(v for v in _pod(d)["volumes"] if v["name"] == name)


def _add_args(d, *words):
    _c(d)["args"].extend(words)


BREAKS = [
    ("service selector", _mutate("router.yaml", "Service", "pushkv-router",
                                 lambda d: d["spec"]["selector"].update({"app.kubernetes.io/component": "routr"})),
     "matches no pod template"),
    ("service targetPort", _mutate("router.yaml", "Service", "pushkv-router",
                                   lambda d: d["spec"]["ports"][0].update(targetPort="web")),
     "is not a container port"),
    ("missing secret key", _mutate("router.yaml", "Deployment", "pushkv-router",
                                   lambda d: _env(d, "PUSHKV_API_KEY")["valueFrom"]["secretKeyRef"].update(key="apikey")),
     "has no key 'apikey'"),
    ("missing secret", _mutate("prefill.yaml", "Deployment", "pushkv-prefill",
                               lambda d: _volume(d, "curve")["secret"].update(secretName="curve")),
     "Secret 'curve' is not in deploy/"),
    ("missing configmap", _mutate("decode.yaml", "Deployment", "pushkv-decode",
                                  lambda d: _volume(d, "config")["configMap"].update(name="cfg")),
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
    ("api key on the command line", _mutate("router.yaml", "Deployment", "pushkv-router",
                                            lambda d: _add_args(d, "--api-key", "$(PUSHKV_API_KEY)")),
     "puts Secret 'pushkv-secrets' key 'api-key' on its command line"),
    ("probe port", _mutate("decode.yaml", "Deployment", "pushkv-decode",
                           lambda d: _c(d)["readinessProbe"]["httpGet"].update(port="metric")),
     "readinessProbe port 'metric' is not one of its container ports"),
    ("no liveness probe", _mutate("prefill.yaml", "Deployment", "pushkv-prefill", lambda d: _c(d).pop("livenessProbe")),
     "no livenessProbe"),
    ("missing claim", _mutate("prefill.yaml", "Deployment", "pushkv-prefill",
                              lambda d: _volume(d, "models")["persistentVolumeClaim"].update(claimName="models")),
     "PersistentVolumeClaim 'models' is not in deploy/"),
    ("HF_HOME off the volume", _mutate("decode.yaml", "Deployment", "pushkv-decode",
                                       lambda d: _env(d, "HF_HOME").update(value="/root/.cache/huggingface")),
     "HF_HOME /root/.cache/huggingface is on no mounted volume"),
    ("ServiceMonitor selector", _mutate("servicemonitor.yaml", "ServiceMonitor", "pushkv",
                                        lambda d: d["spec"]["selector"]["matchLabels"].update({"x": "y"})),
     "matches no Service's labels"),
    ("ServiceMonitor port", _mutate("servicemonitor.yaml", "ServiceMonitor", "pushkv",
                                    lambda d: d["spec"]["endpoints"][0].update(port="http")),
     "endpoint port 'http' is not a named port of Service/pushkv-instance-metrics"),
    ("grace shorter than the drain", _mutate("decode.yaml", "Deployment", "pushkv-decode",
                                             lambda d: _pod(d).update(terminationGracePeriodSeconds=65)),
     "terminationGracePeriodSeconds 65 is shorter than its stop (0 s preStop + --shutdown-timeout 60 s"),
    ("grace shorter than a preStop and the drain", _mutate(
        "router.yaml", "Deployment", "pushkv-router",
        lambda d: _c(d).update(lifecycle={"preStop": {"sleep": {"seconds": 15}}})),
     "terminationGracePeriodSeconds 40 is shorter than its stop (15 s preStop + --shutdown-timeout 20 s"),
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


def test_the_image_user_reads_every_secret_file():
    assert cd.secret_access_problems(_docs(), cd.image_user(DEPLOY)) == []


ACCESS_BREAKS = [
    # the manifests before the fix: uid 10001 and root's 0400 files, no fsGroup (pushkv up: Permission denied)
    ("no fsGroup", _mutate("prefill.yaml", "Deployment", "pushkv-prefill", lambda d: _pod(d).pop("securityContext")),
     "runs as uid 10001, which cannot read /etc/pushkv/curve.secret"),
    ("fsGroup, mode 0400 kept", _mutate("decode.yaml", "Deployment", "pushkv-decode",
                                        lambda d: _volume(d, "etcd-password")["secret"].update(defaultMode=0o400)), None),
    ("secret open to all", _mutate("router.yaml", "Deployment", "pushkv-router",
                                   lambda d: _volume(d, "curve")["secret"].update(defaultMode=0o444)),
     "--secret-file /etc/pushkv/curve.secret has mode 0444 (every user may read it): pushkv up refuses it"),
    ("root in the container", _mutate("prefill.yaml", "Deployment", "pushkv-prefill",
                                      lambda d: _pod(d).update(securityContext={"runAsUser": 0})), None),
]


@pytest.mark.parametrize("what, mutate, expect", ACCESS_BREAKS, ids=[b[0] for b in ACCESS_BREAKS])
def test_secret_access_checks_catch(what, mutate, expect):
    """kubelet's rule: a Secret file is root's; with fsGroup it is that group's, mode | 0440."""
    problems = cd.secret_access_problems(mutate(copy.deepcopy(_docs())), 10001)
    if expect is None:
        assert problems == [], what
    else:
        assert any(expect in p for p in problems), (what, problems)


def test_a_broken_file_fails_the_whole_check(tmp_path):
    d = tmp_path / "deploy"
    shutil.copytree(DEPLOY, d)
    assert cd.check(str(d), schemas=False) == []
    (d / "router.yaml").write_text((d / "router.yaml").read_text() + "\n  bad: [indent\n")
    (d / "extra.yaml").write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "ConfigMap",
                                                  "metadata": {"name": "x", "namespace": "pushkv"}}))
    with open(d / "kustomization.yaml", "a") as f:
        f.write("  - servicemonitor.yaml\n")
    (d / "Dockerfile").write_text("FROM python:3.12\nRUN bash tools/install.sh\n")
    problems = cd.check(str(d), schemas=False)
    assert any("router.yaml: does not parse" in p for p in problems)
    assert any("extra.yaml is not listed" in p for p in problems)
    assert any("lists servicemonitor.yaml, whose kinds exist only with an operator's CRDs" in p for p in problems)
    assert any("Dockerfile: FROM python:3.12 is not a CUDA base" in p for p in problems)
    assert any("Dockerfile: installs no CUDA torch" in p for p in problems)
