"""deploy/k8s rendered with `kubectl kustomize` for every overlay and checked statically: core objects
with kubernetes-validate (strict, Kubernetes 1.32), KubeRay's objects against a subset of KubeRay's
v1 API (tests/deploy/schemas/kuberay-v1.json) with their pod templates as core PodTemplates, the
Prometheus Operator's objects against theirs and promtool; then what the manifests promise
(network isolation, pod security, GPU scheduling, storage, the run's config). No API server runs.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.deploy.tools import (
    KUBERNETES_VERSION,
    OVERLAYS,
    ROOT,
    SCHEMAS,
    by_kind,
    gauges_outlive_a_scrape,
    load_generator,
    normalise_relabel,
    one,
    pod_templates,
)
from tests.helpers.cli import trainforge_command, trainforge_on_path
from trainforge.config import load_config

Docs = dict[str, list[dict[str, Any]]]
CUSTOM_GROUPS = ("ray.io/", "monitoring.coreos.com/")
MONITORING = ROOT / "deploy" / "monitoring"


def schema_for(file: str, kind: str) -> jsonschema.protocols.Validator:
    schema = json.loads((SCHEMAS / file).read_text())
    return jsonschema.Draft202012Validator({**schema, "$ref": f"#/$defs/{kind}"})


def strict_core(obj: dict[str, Any]) -> None:
    kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_every_overlay_renders_the_same_set_of_kinds(rendered: Docs) -> None:
    assert set(OVERLAYS) == {"cpu-dev", "gpu"}
    expected = {
        "Namespace", "ServiceAccount", "Role", "RoleBinding", "NetworkPolicy", "ResourceQuota", "LimitRange",
        "ConfigMap", "RayCluster", "RayJob", "PodMonitor", "PrometheusRule",
    }  # fmt: skip
    for overlay, docs in rendered.items():
        kinds = {d["kind"] for d in docs}
        assert expected <= kinds, f"{overlay} lacks {expected - kinds}"
        namespace = one(docs, "Namespace")["metadata"]["name"]
        assert all(d["metadata"].get("namespace", namespace) == namespace for d in docs), overlay
        # Credentials are never in Git: Secrets are created in the cluster (docs/deploy.md).
        assert not by_kind(docs, "Secret"), overlay


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_core_objects_validate_strictly(rendered: Docs, overlay: str) -> None:
    core = [d for d in rendered[overlay] if not d["apiVersion"].startswith(CUSTOM_GROUPS)]
    assert len(core) >= 15
    for obj in core:
        strict_core(obj)


def test_strict_validation_rejects_an_unknown_field() -> None:
    bad = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "x"}, "automountToken": False}
    with pytest.raises(kubernetes_validate.ValidationError, match="automountToken"):
        strict_core(bad)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kuberay_objects_match_the_v1_api(rendered: Docs, overlay: str) -> None:
    docs = rendered[overlay]
    namespace = one(docs, "Namespace")["metadata"]["name"]
    for kind in ("RayCluster", "RayJob"):
        obj = one(docs, kind)
        errors = [f"{list(e.absolute_path)}: {e.message}" for e in schema_for("kuberay-v1.json", kind).iter_errors(obj)]
        assert not errors, f"{overlay} {kind}:\n" + "\n".join(errors)
        # ObjectMeta through a core object that carries nothing else.
        strict_core({"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj["metadata"]})
    # The embedded core types (PodTemplateSpec; the autoscaler's container fields) as core objects.
    for template in pod_templates(docs):
        strict_core({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t", "namespace": namespace},
                     "template": template.template})  # fmt: skip
    options = one(docs, "RayCluster")["spec"]["autoscalerOptions"]
    autoscaler = {"name": "autoscaler", "image": "x:1", **{k: v for k, v in options.items() if k in
                  ("resources", "securityContext", "env", "envFrom", "volumeMounts", "command", "args")}}  # fmt: skip
    strict_core({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "a"}, "spec": {"containers": [autoscaler]}})


def test_the_kuberay_schema_rejects_misspelt_and_misplaced_fields(rendered: Docs) -> None:
    cluster = one(rendered["gpu"], "RayCluster")
    validator = schema_for("kuberay-v1.json", "RayCluster")
    assert validator.is_valid(cluster)
    misspelt = json.loads(json.dumps(cluster))
    misspelt["spec"]["workerGroupSpecs"][0]["maxReplica"] = 8
    assert not validator.is_valid(misspelt)
    misplaced = json.loads(json.dumps(cluster))
    misplaced["spec"]["headGroupSpec"]["minReplicas"] = 1
    assert not validator.is_valid(misplaced)


def test_the_prometheus_rule_is_generated_from_the_rule_files() -> None:
    generator = load_generator(MONITORING / "kubernetes" / "prometheusrule.py")
    assert generator.OUTPUT.read_text() == generator.render(), (
        "deploy/monitoring/kubernetes/prometheusrule.yaml is stale: run "
        "`.venv/bin/python deploy/monitoring/kubernetes/prometheusrule.py`"
    )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_monitoring_objects_match_the_operator_api(rendered: Docs, overlay: str) -> None:
    docs = rendered[overlay]
    for kind in ("PodMonitor", "PrometheusRule"):
        errors = [e.message for e in schema_for("monitoring-coreos-v1.json", kind).iter_errors(one(docs, kind))]
        assert not errors, f"{overlay} {kind}: {errors}"
    # The PodMonitor relabels as the file_sd scrape job does (the rules read job="ray" and trainforge_*).
    scrape = yaml.safe_load((MONITORING / "prometheus" / "prometheus.yml").read_text())["scrape_configs"][0]
    endpoint = one(docs, "PodMonitor")["spec"]["podMetricsEndpoints"][0]
    assert [normalise_relabel(r) for r in endpoint["metricRelabelings"]] == [
        normalise_relabel(r) for r in scrape["metric_relabel_configs"]
    ]
    assert {"action": "replace", "target_label": "job", "replacement": "ray"} in [
        normalise_relabel(r) for r in endpoint["relabelings"]
    ]
    # The dashboards are deploy/monitoring's files, byte for byte, labelled for Grafana's sidecar.
    dashboards = [d for d in by_kind(docs, "ConfigMap") if d["metadata"].get("labels", {}).get("grafana_dashboard")]
    shipped = {p.name: p.read_text() for p in (MONITORING / "grafana" / "dashboards").glob("*.json")}
    assert {name: text for d in dashboards for name, text in d["data"].items()} == shipped


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_pod_monitor_scrapes_every_ray_gauge_before_the_agent_drops_it(rendered: Docs, overlay: str) -> None:
    """Every Ray container's gauges stay on its agent two export intervals after their last push:
    the PodMonitor's interval is within that, so a rank that lives less than a scrape interval is
    scraped all the same."""
    docs = rendered[overlay]
    (endpoint,) = one(docs, "PodMonitor")["spec"]["podMetricsEndpoints"]
    ray_containers = [
        c
        for t in pod_templates(docs)
        for c in t.template["spec"]["containers"]
        if any(port.get("name") == "metrics" for port in c.get("ports", []))
    ]
    assert ray_containers
    for c in ray_containers:
        export_ms = {e["name"]: e.get("value") for e in c.get("env", [])}.get("RAY_metrics_report_interval_ms")
        assert gauges_outlive_a_scrape(endpoint["interval"], export_ms), (c["name"], endpoint["interval"], export_ms)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (.ci/run installs Debian's)")
def test_promtool_accepts_the_rendered_rules(rendered: Docs, tmp_path: Path) -> None:
    rules = tmp_path / "rules.yml"
    rules.write_text(yaml.safe_dump({"groups": one(rendered["gpu"], "PrometheusRule")["spec"]["groups"]}))
    checked = subprocess.run(["promtool", "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def ray_ports(cluster: dict[str, Any]) -> set[int]:
    """Every port Ray listens on in this cluster: the fixed ones and Ray's defaults for the rest."""
    ports = {6379, 8265, 10001, 52365}
    for params in [cluster["spec"]["headGroupSpec"]["rayStartParams"]] + [
        g["rayStartParams"] for g in cluster["spec"]["workerGroupSpecs"]
    ]:
        for key, value in params.items():
            if key.endswith("-port") and key != "metrics-export-port":
                ports.add(int(value))
        ports.update(range(int(params["min-worker-port"]), int(params["max-worker-port"]) + 1))
    return ports


def allowed(rule_ports: list[dict[str, Any]]) -> set[int]:
    return {p for spec in rule_ports for p in range(spec["port"], spec.get("endPort", spec["port"]) + 1)}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_deny_by_default_and_admit_only_rays_ports(rendered: Docs, overlay: str) -> None:
    docs = rendered[overlay]
    policies = {p["metadata"]["name"]: p["spec"] for p in by_kind(docs, "NetworkPolicy")}
    deny = policies["default-deny-all"]
    assert deny == {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}
    cluster = one(docs, "RayCluster")
    name = cluster["metadata"]["name"]
    intra = policies["ray-intra-cluster"]
    assert intra["podSelector"] == {"matchLabels": {"ray.io/cluster": name}}
    assert ray_ports(cluster) <= allowed(intra["ingress"][0]["ports"])
    # Nothing from another namespace but Prometheus on the metrics port and the KubeRay operator
    # on the Jobs API; no ipBlock peers, so nothing from outside the cluster at all.
    foreign: set[tuple[str, int]] = set()
    for policy in policies.values():
        for rule in policy.get("ingress", []):
            for peer in rule["from"]:
                assert "ipBlock" not in peer
                if "namespaceSelector" in peer:
                    ns = peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
                    foreign |= {(ns, p) for p in allowed(rule["ports"])}
    assert foreign == {("monitoring", 8080), ("kuberay-system", 8265)}
    # The dashboard and Jobs API stay inside the cluster: a ClusterIP head service, none allowed else.
    assert cluster["spec"]["headGroupSpec"]["serviceType"] == "ClusterIP"
    assert one(docs, "ResourceQuota")["spec"]["hard"]["services.loadbalancers"] == "0"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_run_non_root_with_limits_probes_and_pinned_images(rendered: Docs, overlay: str) -> None:
    docs = rendered[overlay]
    templates = list(pod_templates(docs))
    assert {t.role for t in templates} >= {"head", "submitter"} and any(t.role.startswith("worker:") for t in templates)
    for t in templates:
        pod = t.template["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] >= 10000
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert pod["automountServiceAccountToken"] is (t.role == "head"), t.role
        for c in t.containers():
            where = f"{overlay} {t.role} {c['name']}"
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}, where
            assert sc["readOnlyRootFilesystem"] is True, where
            for bound in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][bound]), where
            assert re.fullmatch(r"[\w./-]+:\d[\w.-]*", c["image"]) and not c["image"].endswith(":latest"), where
            if t.role != "submitter":
                assert "readinessProbe" in c and "livenessProbe" in c, where
    options = one(docs, "RayCluster")["spec"]["autoscalerOptions"]
    assert options["securityContext"]["readOnlyRootFilesystem"] is True
    assert {"cpu", "memory"} <= set(options["resources"]["limits"])


def test_the_gpu_overlay_schedules_whole_gpu_nodes_within_autoscaling_bounds(rendered: Docs) -> None:
    cluster = one(rendered["gpu"], "RayCluster")
    assert cluster["spec"]["enableInTreeAutoscaling"] is True
    (group,) = cluster["spec"]["workerGroupSpecs"]
    assert group["groupName"] == "gpu"
    assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    spec = group["template"]["spec"]
    resources = spec["containers"][0]["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == "8"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    quota = one(rendered["gpu"], "ResourceQuota")["spec"]["hard"]
    assert int(quota["requests.nvidia.com/gpu"]) >= group["maxReplicas"] * 8
    run = run_config(rendered["gpu"])
    assert run.scaling.use_gpu and run.scaling.resources_per_worker == {"CPU": 3.0, "GPU": 1.0}
    cpu_group = one(rendered["cpu-dev"], "RayCluster")["spec"]["workerGroupSpecs"][0]
    assert "nvidia.com/gpu" not in cpu_group["template"]["spec"]["containers"][0]["resources"]["limits"]


def run_config(docs: list[dict[str, Any]]) -> Any:
    """The RayJob's run as `trainforge train` resolves it on the head: the mounted ConfigMap's
    file, then the job's TRAINFORGE_ variables (runtimeEnvYAML)."""
    job = one(docs, "RayJob")
    entry = job["spec"]["entrypoint"].split()
    assert entry[:2] == ["trainforge", "train"]
    head = one(docs, "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]
    mount = next(m for m in head["containers"][0]["volumeMounts"] if entry[2].startswith(m["mountPath"] + "/"))
    volume = next(v for v in head["volumes"] if v["name"] == mount["name"])
    config_map = one(docs, "ConfigMap", volume["configMap"]["name"])
    text = config_map["data"][entry[2][len(mount["mountPath"]) + 1 :]]
    env = yaml.safe_load(job["spec"].get("runtimeEnvYAML", "{}") or "{}").get("env_vars", {})
    return load_config(yaml.safe_load(text), env=env)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_job_runs_trainforge_on_the_cluster_with_a_valid_config(rendered: Docs, overlay: str) -> None:
    docs = rendered[overlay]
    job = one(docs, "RayJob")
    cluster = one(docs, "RayCluster")
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": cluster["metadata"]["name"]}
    assert run_config(docs).checkpoint.storage_path
    # Ray token authentication from a Secret the operator reads (never a literal token).
    assert cluster["spec"]["authOptions"] == {"mode": "token", "secretName": "trainforge-ray-auth"}
    assert "RAY_AUTH_TOKEN" not in json.dumps(docs)


def test_each_overlay_selects_one_checkpoint_storage(rendered: Docs) -> None:
    dev = rendered["cpu-dev"]
    pvc = one(dev, "PersistentVolumeClaim", "trainforge-checkpoints")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    for t in pod_templates(dev):
        if t.role != "submitter":
            mounts = {m["name"]: m["mountPath"] for m in t.containers()[0]["volumeMounts"]}
            assert mounts["checkpoints"] == "/mnt/trainforge", t.role
    assert run_config(dev).checkpoint.storage_path.startswith("/mnt/trainforge/")
    assert "s3-credentials" not in json.dumps(dev)

    gpu = rendered["gpu"]
    assert not by_kind(gpu, "PersistentVolumeClaim")
    for t in pod_templates(gpu):
        if t.role != "submitter":
            volumes = {v["name"]: v for v in t.template["spec"]["volumes"]}
            assert volumes["s3-credentials"]["secret"]["secretName"] == "trainforge-s3"
            env = {e["name"]: e.get("value") for e in t.containers()[0]["env"]}
            assert env["AWS_SHARED_CREDENTIALS_FILE"] == "/var/run/secrets/trainforge/s3/credentials"
    assert run_config(gpu).checkpoint.storage_path.startswith("s3://")


TLS_VARIABLES = ("RAY_USE_TLS", "RAY_TLS_SERVER_CERT", "RAY_TLS_SERVER_KEY", "RAY_TLS_CA_CERT")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_ray_process_runs_with_tls_from_its_pods_own_certificate(rendered: Docs, overlay: str) -> None:
    """Head, workers and the autoscaler get Ray's TLS variables naming files of the memory volume
    the init container fills; the CA's Secret is mounted in the init container only."""
    docs = rendered[overlay]
    cluster = one(docs, "RayCluster")
    ray_pods = [t for t in pod_templates(docs) if t.role != "submitter"]
    checked = [*(t.containers()[0] for t in ray_pods), cluster["spec"]["autoscalerOptions"]]
    for container in checked:
        env = {e["name"]: e.get("value") for e in container["env"]}
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        assert env["RAY_USE_TLS"] == "1", container.get("name", "autoscaler")
        assert mounts["ray-tls"]["readOnly"] is True and "ray-tls-ca" not in mounts
        assert all(env[name].startswith(mounts["ray-tls"]["mountPath"] + "/") for name in TLS_VARIABLES[1:])
    for t in ray_pods:
        volumes = {v["name"]: v for v in t.template["spec"]["volumes"]}
        assert volumes["ray-tls"]["emptyDir"]["medium"] == "Memory"
        assert volumes["ray-tls-ca"]["secret"] == {"secretName": "trainforge-ray-ca", "defaultMode": 0o400}
        (init,) = t.template["spec"]["initContainers"]
        assert {m["name"] for m in init["volumeMounts"]} >= {"ray-tls", "ray-tls-ca"}
        assert init["securityContext"]["readOnlyRootFilesystem"] is True and init["resources"]["limits"]
        assert "$(POD_IP)" in init["command"][-1]
        assert ("trainforge-head-svc" in init["command"][-1]) is (t.role == "head"), t.role  # the name workers dial
    submitter = next(t for t in pod_templates(docs) if t.role == "submitter")
    assert "ray-tls" not in json.dumps(submitter.template)  # it speaks HTTP to the dashboard only


def test_the_init_containers_command_makes_a_certificate_for_the_pods_ip(rendered: Docs, tmp_path: Path) -> None:
    """The head's init command as the kubelet runs it ($(VAR) expanded), with the trainforge these
    tests import (this interpreter's) on PATH and the paths moved under tmp_path: a certificate the
    CA signed, for the pod's IP and the head service's names; run twice (a restarted pod), it
    replaces the first one."""
    from cryptography import x509

    ca = tmp_path / "ca"
    subprocess.run([*trainforge_command(), "certs", "create", str(ca)], check=True, capture_output=True, timeout=120)
    (head,) = [t for t in pod_templates(rendered["cpu-dev"]) if t.role == "head"]
    (init,) = head.template["spec"]["initContainers"]
    mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
    argv = [
        part.replace(mounts["ray-tls-ca"], str(ca)).replace(mounts["ray-tls"], str(tmp_path / "tls"))
        for part in init["command"]
    ]
    argv[-1] = argv[-1].replace("$(POD_IP)", "10.244.3.9").replace("$(POD_NAMESPACE)", "trainforge-dev")
    (tmp_path / "tls").mkdir()
    env = {"PATH": f"{trainforge_on_path(tmp_path / 'bin')}:/usr/bin:/bin", "HOME": str(tmp_path)}
    for _ in range(2):
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
    node = x509.load_pem_x509_certificate((tmp_path / "tls" / "node" / "node.crt").read_bytes())
    node.verify_directly_issued_by(x509.load_pem_x509_certificate((ca / "ca.crt").read_bytes()))
    names = node.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["10.244.3.9", "127.0.0.1"]
    assert "trainforge-head-svc.trainforge-dev.svc.cluster.local" in names.get_values_for_type(x509.DNSName)
    assert sorted(p.name for p in (tmp_path / "tls" / "node").iterdir()) == ["ca.crt", "node.crt", "node.key"]
