"""deploy/: the files parse, and the fields that make a cluster work agree with each other."""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from pathlib import Path

import pytest
import yaml

from groupflow.run.job_config import build_config

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
IMAGE = "ghcr.io/groupflow/groupflow:0.1.0-cuda"
METRICS_PORT = 9450
RAY_SD_FILE = "/tmp/ray/prom_metrics_service_discovery.json"
GROUPS = ("generation", "reward", "learning")
GPU_GROUPS = {"generation", "learning"}
# Each worker group's own custom resource, which pins the matching actors to it.
GROUP_RESOURCE = {
    "generation": "groupflow_rollout",
    "reward": "groupflow_reward",
    "learning": "groupflow_learner",
}


def load_yaml_docs(relative: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((DEPLOY / relative).read_text()) if d]


def raycluster_spec() -> dict:
    (doc,) = load_yaml_docs("kuberay/raycluster.yaml")
    assert (doc["apiVersion"], doc["kind"]) == ("ray.io/v1", "RayCluster")
    return doc["spec"]


def rayjob_docs() -> tuple[dict, dict]:
    docs = {d["kind"]: d for d in load_yaml_docs("kuberay/rayjob.yaml")}
    assert docs["RayJob"]["apiVersion"] == "ray.io/v1"
    return docs["ConfigMap"], docs["RayJob"]


def kuberay_specs() -> dict[str, dict]:
    return {"raycluster": raycluster_spec(), "rayjob": rayjob_docs()[1]["spec"]["rayClusterSpec"]}


def containers(pod_template: dict) -> list[dict]:
    return pod_template["spec"]["containers"]


def custom_resources(group: dict) -> dict[str, float]:
    # KubeRay passes the value to `ray start --resources=...` as a quoted JSON string.
    return json.loads(json.loads(group["rayStartParams"]["resources"]))


def dockerfile_ray_version() -> str:
    text = (DEPLOY / "Dockerfile").read_text()
    match = re.search(r"^ARG RAY_IMAGE=rayproject/ray:(\d+\.\d+\.\d+)-py311-cu\d+$", text, re.M)
    assert match, "the Dockerfile must start from a CUDA rayproject/ray image for Python 3.11"
    return match.group(1)


# ----- Dockerfile ---------------------------------------------------------------------------


def test_dockerfile_installs_groupflow_with_the_cuda_extra():
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^FROM \$\{RAY_IMAGE\}$", text, re.M)
    assert re.search(r'pip install [^\n]*"\.\[cuda\]"', text)
    copied = set(re.findall(r"^COPY (?:--chown=\S+ )?(.+?) \S+$", text, re.M))
    copied = {name.rstrip("/") for line in copied for name in line.split()}
    pyproject = tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())
    source_dirs = set(pyproject["tool"]["setuptools"]["package-dir"].values())
    assert source_dirs | {"pyproject.toml", "README.md"} <= copied


# ----- Ray cluster launcher -----------------------------------------------------------------


def test_cluster_launcher_has_a_node_type_per_actor_kind():
    config = yaml.safe_load((DEPLOY / "ray-cluster.yaml").read_text())
    assert config["docker"]["image"] == IMAGE
    types = config["available_node_types"]
    assert types[config["head_node_type"]]["resources"]["CPU"] == 0  # no actors on the head
    for group in GROUPS:
        node = types[group]
        resources = node["resources"]
        assert resources[GROUP_RESOURCE[group]] > 0
        assert (resources.get("GPU", 0) > 0) == (group in GPU_GROUPS), group
        assert 0 < node["min_workers"] <= node["max_workers"]
        others = set(GROUP_RESOURCE.values()) - {GROUP_RESOURCE[group]}
        assert not others & set(resources), f"{group} offers another group's resource"


def test_cluster_launcher_passes_rays_own_schema():
    # Ray's private helpers: they fill in the defaults `ray up` would, then validate.
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(yaml.safe_load((DEPLOY / "ray-cluster.yaml").read_text())))


# ----- KubeRay ------------------------------------------------------------------------------


@pytest.mark.parametrize("manifest", ["raycluster", "rayjob"])
def test_kuberay_worker_groups_scale_separately_with_their_resources(manifest):
    spec = kuberay_specs()[manifest]
    assert spec["rayVersion"] == dockerfile_ray_version()
    assert spec["enableInTreeAutoscaling"] is True
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    assert set(groups) == set(GROUPS)
    for name, group in groups.items():
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], name
        resources = custom_resources(group)
        assert set(resources) == {GROUP_RESOURCE[name]} and resources[GROUP_RESOURCE[name]] > 0
        (container,) = containers(group["template"])
        assert container["image"] == IMAGE
        limits = container["resources"]["limits"]
        assert (int(limits.get("nvidia.com/gpu", 0)) > 0) == (name in GPU_GROUPS), name
        assert limits["cpu"] and limits["memory"], name


@pytest.mark.parametrize("manifest", ["raycluster", "rayjob"])
def test_kuberay_head_runs_no_actors_and_exposes_the_metrics_port(manifest):
    head = kuberay_specs()[manifest]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    (container,) = containers(head["template"])
    assert container["image"] == IMAGE
    assert METRICS_PORT in {p["containerPort"] for p in container["ports"]}


def test_every_pod_mounts_the_shared_read_write_many_volume():
    (claim,) = load_yaml_docs("kuberay/shared-storage.yaml")
    assert claim["kind"] == "PersistentVolumeClaim"
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    for spec in kuberay_specs().values():
        for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
            pod = group["template"]["spec"]
            claims = {
                v["persistentVolumeClaim"]["claimName"]
                for v in pod["volumes"]
                if "persistentVolumeClaim" in v
            }
            assert claims == {claim["metadata"]["name"]}
            mounts = {m["mountPath"] for m in containers(group["template"])[0]["volumeMounts"]}
            assert "/mnt/shared" in mounts


def test_rayjob_runs_groupflow_train_on_its_mounted_config():
    config_map, job = rayjob_docs()
    entrypoint = shlex.split(job["spec"]["entrypoint"])
    assert entrypoint[:2] == ["groupflow", "train"]
    config_path = Path(entrypoint[2])
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]
    volumes = {v["name"]: v for v in head["spec"]["volumes"]}
    mount = next(
        m for m in containers(head)[0]["volumeMounts"] if m["mountPath"] == str(config_path.parent)
    )
    assert volumes[mount["name"]]["configMap"]["name"] == config_map["metadata"]["name"]
    assert config_path.name in config_map["data"]
    assert job["spec"]["shutdownAfterJobFinishes"] is True


def test_rayjob_config_is_valid_and_fits_the_cluster():
    config_map, job = rayjob_docs()
    cfg = build_config(yaml.safe_load(config_map["data"]["job.yaml"]))  # raises if invalid
    assert cfg.metrics.prometheus_port == METRICS_PORT
    assert cfg.trainer.output_dir.startswith("/mnt/shared/")
    groups = {g["groupName"]: g for g in job["spec"]["rayClusterSpec"]["workerGroupSpecs"]}

    def gpus(group: str) -> int:
        limits = containers(groups[group]["template"])[0]["resources"]["limits"]
        return int(limits["nvidia.com/gpu"]) * groups[group]["replicas"]

    rollout, learner = cfg.rollout, cfg.learner
    assert rollout.resources.num_gpus > 0 and learner.resources.num_gpus > 0
    assert rollout.num_engines * rollout.resources.num_gpus <= gpus("generation")
    assert learner.num_ranks * learner.resources.num_gpus <= gpus("learning")
    reward_cpus = (
        custom_resources(groups["reward"])["groupflow_reward"] * groups["reward"]["replicas"]
    )
    assert cfg.reward.num_workers * cfg.reward.resources.num_cpus <= reward_cpus


# ----- Prometheus ---------------------------------------------------------------------------


def test_prometheus_scrapes_the_job_endpoint_and_rays_discovery_file():
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    jobs = {c["job_name"]: c for c in config["scrape_configs"]}
    groupflow = jobs["groupflow"]
    # Keeps the exporter's job label (the run name) that the dashboard filters on.
    assert groupflow["honor_labels"] is True
    targets = [t for sc in groupflow["static_configs"] for t in sc["targets"]]
    assert [int(t.rsplit(":", 1)[1]) for t in targets] == [METRICS_PORT]
    ray_files = [f for sd in jobs["ray"]["file_sd_configs"] for f in sd["files"]]
    assert ray_files == [RAY_SD_FILE]


def test_rayjob_actors_request_their_worker_groups_resource():
    config_map, job = rayjob_docs()
    cfg = build_config(yaml.safe_load(config_map["data"]["job.yaml"]))
    groups = {g["groupName"]: g for g in job["spec"]["rayClusterSpec"]["workerGroupSpecs"]}
    for section, group in (
        ("rollout", "generation"),
        ("reward", "reward"),
        ("learner", "learning"),
    ):
        wanted = getattr(cfg, section).resources.custom
        offered = custom_resources(groups[group])
        assert wanted and set(wanted) <= set(offered), (section, wanted, offered)
