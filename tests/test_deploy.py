"""deploy/: every manifest validates against KubeRay's own CRD schemas (v1.7.0, a verbatim
copy in tests/data/kuberay-crds, see its SOURCE.md) with unknown fields rejected, obeys the
operator's rules that the schemas do not express, and asks for what an elastic_dp run
needs."""

from __future__ import annotations

import copy
import hashlib
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import tomllib
import yaml

from elastic_dp.cli import _parser

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
CRDS = ROOT / "tests" / "data" / "kuberay-crds"
CRD_FILES = {"RayCluster": "ray.io_rayclusters.yaml", "RayJob": "ray.io_rayjobs.yaml"}
DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def _strict(schema):
    """The CRD's structural schema, made strict for validation (see SOURCE.md there):
    objects with properties reject unknown fields, and properties that the API server
    defaults are not required."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        props = schema.get("properties")
        if isinstance(props, dict) and schema.get("type") == "object" and "additionalProperties" not in schema \
                and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
        if isinstance(props, dict) and "required" in schema:
            schema["required"] = [r for r in schema["required"] if "default" not in props.get(r, {})]
        return schema
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def test_the_crd_schemas_are_kuberays_own():
    """The copies are byte for byte the files SOURCE.md names (KubeRay v1.7.0)."""
    source = (CRDS / "SOURCE.md").read_text()
    for file in CRD_FILES.values():
        digest = hashlib.sha256((CRDS / file).read_bytes()).hexdigest()
        assert re.search(rf"\| {re.escape(file)}\s*\|[^|]*\| {digest} \|", source), file


@pytest.fixture(scope="module")
def validators():
    found = {}
    for kind, file in CRD_FILES.items():
        crd = yaml.load((CRDS / file).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        v1 = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
        found[kind] = jsonschema.Draft7Validator(_strict(v1["schema"]["openAPIV3Schema"]))
    return found


def _documents(path: Path) -> list[dict]:
    assert path.is_file(), f"{path} is missing"
    text = path.read_text()
    docs = [d for d in yaml.safe_load_all(text) if d]
    assert docs, f"{path} holds no manifest"
    return docs


def _field(doc, path: str, value=None):
    """Read (or, given ``value``, write) ``doc``'s field at the dotted ``path``."""
    keys = [int(k) if k.isdigit() else k for k in path.split(".")]
    for key in keys[:-1]:
        doc = doc[key]
    if value is None:
        return doc[keys[-1]]
    doc[keys[-1]] = copy.deepcopy(value)


def _selects(doc, select: dict) -> bool:
    return doc["kind"] == select["kind"] and doc["metadata"]["name"] == select.get("name", doc["metadata"]["name"])


def render(directory: Path) -> list[dict]:
    """What ``kubectl kustomize directory`` renders, for the features deploy/ uses:
    resources (files and directories), images, JSON patches that add a field,
    replacements, and local-config resources left out of the output.
    ``test_kustomize_renders_what_the_tests_check`` compares it with the real one."""
    kustomization = _documents(directory / "kustomization.yaml")[0]
    docs = []
    for resource in kustomization.get("resources", []):
        path = directory / resource
        docs.extend(render(path) if path.is_dir() else _documents(path))
    for image in kustomization.get("images", []):
        for doc in docs:
            for container in _all_containers(doc):
                name, _, tag = container["image"].partition(":")
                if name == image["name"]:
                    container["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}"
    for patch in kustomization.get("patches", []):
        for doc in (d for d in docs if _selects(d, patch["target"])):
            for op in yaml.safe_load(patch["patch"]):
                assert op["op"] == "add", op
                _field(doc, op["path"].strip("/").replace("/", "."), op["value"])
    for replacement in kustomization.get("replacements", []):
        source = next(d for d in docs if _selects(d, replacement["source"]))
        value = _field(source, replacement["source"]["fieldPath"])
        for target in replacement["targets"]:
            for doc in (d for d in docs if _selects(d, target["select"])):
                for path in target["fieldPaths"]:
                    _field(doc, path, value)
    return [d for d in docs
            if d.get("metadata", {}).get("annotations", {}).get("config.kubernetes.io/local-config") != "true"]


def _all_containers(doc) -> list[dict]:
    if doc["kind"] not in ("RayJob", "RayCluster"):
        return []
    found = [c for _, _, c in _containers(_cluster_spec(doc))]
    if doc["kind"] == "RayJob":
        found += doc["spec"].get("submitterPodTemplate", {}).get("spec", {}).get("containers", [])
    return found


OVERLAYS = {"rayjob": ["PodDisruptionBudget", "RayJob"], "raycluster": ["PodDisruptionBudget", "RayCluster"]}
"""Each overlay of deploy/ and what it applies: one KubeRay resource each, over one cluster
spec, and the worker pods' disruption budget."""


def _manifests() -> list[dict]:
    """Every KubeRay manifest the overlays apply."""
    return [doc for overlay in OVERLAYS for doc in render(DEPLOY / overlay) if doc["kind"] in CRD_FILES]


def test_kubectl_apply_k_deploy_applies_one_thing_and_each_overlay_its_own():
    assert [d["kind"] for d in render(DEPLOY)] == ["PodDisruptionBudget", "RayJob"]
    for overlay, kinds in OVERLAYS.items():
        assert [d["kind"] for d in render(DEPLOY / overlay)] == kinds, overlay
    (cluster,) = _documents(DEPLOY / "cluster" / "raycluster.yaml")
    job = _documents(DEPLOY / "rayjob" / "rayjob.yaml")[0]
    assert job["spec"]["rayClusterSpec"] == {}, "the RayJob's cluster is ../cluster's, not a copy of it"
    assert cluster["kind"] == "RayCluster" and cluster["spec"]["workerGroupSpecs"]


def _errors(validators, doc) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validators[doc["kind"]].iter_errors(doc)]


def _cluster_spec(doc) -> dict:
    return doc["spec"]["rayClusterSpec"] if doc["kind"] == "RayJob" else doc["spec"]


def _operator_errors(doc) -> list[str]:
    """The checks of KubeRay's validation.go that the schemas do not express."""
    errors = []
    name, limit = doc["metadata"]["name"], {"RayJob": 47, "RayCluster": 53}[doc["kind"]]
    if len(name) > limit or not DNS_1035.match(name):
        errors.append(f"name {name!r}: at most {limit} characters, DNS-1035")
    spec = _cluster_spec(doc)
    for group in spec.get("workerGroupSpecs", []):
        low, high = group.get("minReplicas", 0), group.get("maxReplicas", 2**31 - 1)
        if not low <= group.get("replicas", low) <= high:
            errors.append(f"worker group {group['groupName']}: needs minReplicas <= replicas <= maxReplicas")
    if doc["kind"] == "RayJob" and doc["spec"].get("ttlSecondsAfterFinished", 0) > 0 \
            and not doc["spec"].get("shutdownAfterJobFinishes"):
        errors.append("ttlSecondsAfterFinished needs shutdownAfterJobFinishes: true")
    if spec.get("authOptions", {}).get("mode") == "token":
        version = tuple(int(x) for x in spec.get("rayVersion", "0").split(".")[:3])
        if version < (2, 52, 0):
            errors.append("authOptions.mode token needs rayVersion >= 2.52.0")
    return errors


def test_every_manifest_validates_against_kuberays_schemas_and_rules(validators):
    docs = _manifests()
    assert sorted(d["kind"] for d in docs) == ["RayCluster", "RayJob"]
    for doc in docs:
        assert doc["apiVersion"] == "ray.io/v1"
        assert _errors(validators, doc) == [], doc["kind"]
        assert _operator_errors(doc) == [], doc["kind"]


@pytest.mark.parametrize("mutate, expected", [
    (lambda d: _cluster_spec(d)["headGroupSpec"]["rayStartParams"].update({"num-cpus": 0}), "is not of type"),
    (lambda d: _cluster_spec(d)["workerGroupSpecs"][0].update({"minReplicas": "2"}), "is not of type"),
    (lambda d: _cluster_spec(d)["workerGroupSpecs"][0].update({"maxReplica": 4}), "Additional properties"),
    (lambda d: _cluster_spec(d)["autoscalerOptions"].update({"version": "v3"}), "is not one of"),
    (lambda d: _cluster_spec(d)["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]
     ["limits"].update({"memory": "64 gigs"}), "does not match"),
])
def test_a_wrong_value_or_an_unknown_field_is_caught(validators, mutate, expected):
    for doc in _manifests():
        broken = copy.deepcopy(doc)
        mutate(broken)
        assert any(expected in e for e in _errors(validators, broken)), doc["kind"]


def test_the_operator_rules_catch_what_the_schemas_do_not():
    job = next(d for d in _manifests() if d["kind"] == "RayJob")
    for mutate, expected in [
        (lambda d: d["metadata"].update(name="x" * 48), "at most 47"),
        (lambda d: _cluster_spec(d)["workerGroupSpecs"][0].update(replicas=9), "minReplicas <= replicas"),
        (lambda d: d["spec"].update(shutdownAfterJobFinishes=False), "needs shutdownAfterJobFinishes"),
        (lambda d: _cluster_spec(d).update(rayVersion="2.51.0"), "needs rayVersion >= 2.52.0"),
    ]:
        broken = copy.deepcopy(job)
        mutate(broken)
        assert any(expected in e for e in _operator_errors(broken)), expected


def _containers(spec: dict) -> list[tuple[str, dict, dict]]:
    """(group, pod spec, container) of every Ray container of a cluster spec."""
    groups = [("head", spec["headGroupSpec"])] + [(g["groupName"], g) for g in spec["workerGroupSpecs"]]
    return [(name, g["template"]["spec"], c) for name, g in groups for c in g["template"]["spec"]["containers"]]


def test_the_cluster_is_what_an_elastic_run_needs():
    pinned = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    ray_version = next(d for d in pinned if d.startswith("ray")).split("==")[1]
    job = next(d for d in _manifests() if d["kind"] == "RayJob")
    cluster = next(d for d in _manifests() if d["kind"] == "RayCluster")
    assert job["spec"]["rayClusterSpec"] == cluster["spec"]  # one cluster spec, deploy/cluster
    spec = cluster["spec"]
    assert spec["rayVersion"] == ray_version
    assert spec["enableInTreeAutoscaling"] is True and spec["autoscalerOptions"]["version"] == "v2"
    assert spec["authOptions"] == {"mode": "token", "secretName": "elastic-dp-ray-token"}
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    for group, pod, container in _containers(spec):
        security = pod["securityContext"]
        assert security["runAsNonRoot"] is True and security["seccompProfile"]["type"] == "RuntimeDefault"
        assert container["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
        resources = container["resources"]
        assert resources["requests"] == resources["limits"], group
        shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
        assert shm["emptyDir"]["medium"] == "Memory"
        assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    (gpu,) = spec["workerGroupSpecs"]
    assert gpu["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"

    # The RayJob's entrypoint is a valid command line whose elastic range is the worker group's
    entry = shlex.split(job["spec"]["entrypoint"])
    assert entry[:3] == ["python", "-m", "jobs.gpt"]
    args = _parser().parse_args(["train", "jobs.gpt", *entry[3:]])
    assert args.workers == (gpu["minReplicas"], gpu["maxReplicas"])
    assert args.resume == "auto" and args.storage and args.device == "cuda"
    assert job["spec"]["shutdownAfterJobFinishes"] is True and job["spec"]["ttlSecondsAfterFinished"] > 0
    assert job["spec"]["backoffLimit"] >= 1  # retries resume: --resume auto with --storage
    submitter = job["spec"]["submitterPodTemplate"]["spec"]
    assert submitter["securityContext"]["runAsNonRoot"] is True
    assert submitter["containers"][0]["resources"]["requests"] == submitter["containers"][0]["resources"]["limits"]


def test_the_image_is_built_on_rays_gpu_image_of_the_pinned_version():
    pinned = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    ray_version = next(d for d in pinned if d.startswith("ray")).split("==")[1]
    torch_version = next(d for d in pinned if d.startswith("torch")).split("==")[1]
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    base = re.search(r"^FROM (\S+)", dockerfile, re.M).group(1)
    assert re.fullmatch(rf"rayproject/ray:{re.escape(ray_version)}-py3\d+-gpu", base), base
    assert f"torch=={torch_version}" in dockerfile


def test_kustomize_renders_what_the_tests_check(validators):
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: render() is not compared with the real kustomize here")
    for directory in (DEPLOY, *(DEPLOY / overlay for overlay in OVERLAYS)):
        out = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        rendered = [d for d in yaml.safe_load_all(out.stdout) if d]
        assert rendered == render(directory), directory
        for doc in (d for d in rendered if d["kind"] in CRD_FILES):
            assert _errors(validators, doc) == [] and _operator_errors(doc) == []


def test_a_worker_pod_s_sigterm_leaves_time_for_a_planned_leave():
    """Kubernetes sends SIGTERM to ``ray start --block``, which drains the node with a deadline
    of the drain timeout Ray reads (checked in Ray's own source): the run lets its worker go
    at a step boundary, and the pod's grace period covers the drain, a step and the
    re-formation before the kill. The budget lets voluntary evictions take one worker at a time."""
    from ray._private import node, ray_constants
    name = "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"
    assert f'"{name}"' in Path(ray_constants.__file__).read_text()  # the name Ray 2.60 reads ...
    assert f"ray_constants.{name}" in Path(node.__file__).read_text()  # ... in its SIGTERM handler
    for overlay in OVERLAYS:
        docs = render(DEPLOY / overlay)
        spec = _cluster_spec(next(d for d in docs if d["kind"] in CRD_FILES))
        (gpu,) = spec["workerGroupSpecs"]
        pod = gpu["template"]["spec"]
        env = {e["name"]: e["value"] for e in pod["containers"][0]["env"]}
        drain_s = float(env[name])
        assert drain_s >= 25  # GKE's spot notice is ~30 s; the run needs a step and a re-formation in it
        assert pod["terminationGracePeriodSeconds"] >= drain_s + 20, overlay  # + a step + the re-formation
        (budget,) = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
        assert budget["apiVersion"] == "policy/v1" and budget["spec"]["maxUnavailable"] == 1
        selector = budget["spec"]["selector"]["matchLabels"]
        assert selector.items() <= gpu["template"]["metadata"]["labels"].items()  # it selects the workers ...
        head_labels = spec["headGroupSpec"]["template"].get("metadata", {}).get("labels", {})
        assert not selector.items() <= head_labels.items()  # ... and not the head
