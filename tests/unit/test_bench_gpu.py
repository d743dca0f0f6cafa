"""The bench's GPU profile: its settings and plan, the QA configuration, the slab handles a run
opened, per-process GPU memory from nvidia-smi's output, and the GPU targets. Plain data: what
runs on a GPU is the profile itself (bench/gpu/run_on_device.sh)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.__main__ import default_kinds, make_settings, parse_args, plan
from bench.config import GPU, PROFILES, QUICK, Settings
from bench.contenders import CONTENDERS, GPU_KINDS
from bench.handles import job_handles, per_epoch, run_handles
from bench.memory import _gpu_shares, parse_compute_apps, parse_gpu_reading
from bench.report import targets_table
from bench.targets import all_targets

LABELS = {kind: contender.label for kind, contender in CONTENDERS.items()}


def test_the_gpu_profile_is_the_issues_configuration() -> None:
    assert (GPU.batch_size, GPU.workers, GPU.pipeline) == (256, 8, "train")
    qa = CONTENDERS["dalid-qa"].configure(GPU)
    assert (qa.batch_size, qa.threads, qa.hw_decoder_load) == (408, 70, 0.12)
    assert qa.pipeline == "train" and qa.workers == 8
    assert CONTENDERS["dali-qa"].configure(GPU) == qa
    # Through dalid the QA job keeps its batch and threads: a pipeline of its own.
    assert CONTENDERS["dalid-qa"].daemon_args == ("--share-pipelines", "no")
    assert CONTENDERS["dalid-staged"].daemon_args == ("--gpu-outputs", "staged")
    assert CONTENDERS["dalid"].configure(GPU) == GPU


def test_profiles_from_the_command_line_and_through_json() -> None:
    assert make_settings(parse_args(["--profile", "gpu", "--cpu"])).batch_size == 256
    quick = make_settings(parse_args(["--profile", "gpu", "--quick", "--cpu"]))
    assert quick == PROFILES["gpu"][1] and quick.quick and quick.profile == "gpu"
    assert make_settings(parse_args(["--quick", "--cpu"])) == QUICK
    for settings in (GPU, QUICK):
        assert Settings.from_json(settings.to_json()) == settings


def test_which_contenders_each_profile_runs() -> None:
    gpu = default_kinds(GPU)
    assert set(GPU_KINDS) <= set(gpu)
    assert "torch-pil" not in gpu and "dalid-private" not in gpu
    assert set(GPU_KINDS) <= set(default_kinds(QUICK))  # their code runs in quick mode
    assert not set(GPU_KINDS) & set(default_kinds(Settings()))
    runs, _ = plan(GPU.with_(scaling_jobs=(1, 2, 4, 8), jobs=2), "scaling")
    scaled = ("dali", "dali-proxy", "dalid")
    assert runs == [(kind, jobs) for jobs in (1, 2, 4, 8) for kind in scaled]


def test_the_gpu_scripts_profile_run_holds_dali_proxy_at_1_and_8_jobs() -> None:
    """bench-gpu's first run (bench/gpu/run_on_device.sh), which is also the experiments' base:
    DALI in-process, DALI's proxy and dalid, each at 1 and 8 jobs."""
    only = "dali,dali-proxy,dalid,scaling"
    args = parse_args(["--profile", "gpu", "--cpu", "--only", only, "--scaling-jobs", "1,8"])
    runs, settings = plan(make_settings(args), args.only)
    kinds = ("dali", "dali-proxy", "dalid")
    assert runs == [(kind, 1) for kind in kinds] + [(kind, 8) for kind in kinds]
    assert settings.scaling_jobs == (1, 8)
    # Its dry run (DRY_RUN=1: the profile's quick mode on the CPU) plans the same runs.
    quick = parse_args(["--profile", "gpu", "--quick", "--cpu", "--only", only])
    quick.scaling_jobs = (1, 8)
    assert plan(make_settings(quick), quick.only)[0] == runs
    # The CPU profile's scaling runs keep their three contenders, without the proxy.
    cpu_runs, _ = plan(Settings(jobs=1, scaling_jobs=(1, 8)), "scaling")
    assert {kind for kind, _ in cpu_runs} == {"dali", "dalid", "dalid-private"}
    # The GPU profile's default run has the proxy at 1 job (bench-main).
    assert ("dali-proxy", 1) in plan(GPU, None)[0]


def test_the_gpu_script_runs_the_profile_and_the_experiments_in_one_call() -> None:
    """What one call of the script with no parts does: read from the script, since what runs
    it is a GPU machine (its plumbing is checked with DRY_RUN=1)."""
    script = (Path(__file__).parents[2] / "bench/gpu/run_on_device.sh").read_text()
    assert "set -- setup bench-gpu experiments tests\n" in script
    assert "--only dali,dali-proxy,dalid,scaling --scaling-jobs 1,8" in script
    experiments = script[script.index("part_experiments() {") :]
    for name in ("like-in-process", "run-batches-4", "instances-1", "threads-8", "hw-load"):
        assert f'experiment "$dir" {name} ' in experiments


def _result(job_id: int, opened: list[int], events: list[int], slabs: int | None) -> dict[str, Any]:
    jobs: list[dict[str, Any]] = []
    if slabs is not None:
        peak = slabs << 20
        jobs.append(
            {"job_id": job_id, "slabs": slabs, "output_path": "cuda_ipc", "peak_slab_bytes": peak}
        )
    return {
        "handles": {"job_id": job_id, "slabs_opened": opened, "events_opened": events},
        "pipelines": {"t_ns": 1, "pipelines": [], "jobs": jobs},
    }


def test_slab_handles_per_epoch_and_of_a_run() -> None:
    assert per_epoch([3, 3, 4]) == [3, 0, 1]
    one = job_handles(_result(1, [3, 3, 3], [8, 8, 8], 3), warmup_epochs=1)
    assert one is not None
    assert (one["opens_per_epoch"], one["opens"], one["timed_opens"], one["slabs"]) == (
        [3, 0, 0], 3, 0, 3,
    )  # fmt: skip
    run = run_handles([_result(1, [2, 2, 3], [4, 4, 4], 3), _result(2, [2, 2, 2], [4, 4, 4], 2)], 1)
    assert run is not None
    assert run["opens_per_epoch"] == [4, 0, 1] and run["timed_opens"] == 1 and run["slabs"] == 5
    assert run["output_paths"] == ["cuda_ipc"]
    assert run["peak_slab_bytes_per_job"] == 2.5 * (1 << 20)  # the mean of the jobs' peaks
    assert run_handles([_result(1, [1], [1], None)], 1)["slabs"] is None  # type: ignore[index]
    assert run_handles([{"loop": {}}], 1) is None  # contenders without a session


def test_gpu_memory_per_process_from_nvidia_smi() -> None:
    text = "1234, 620\n1240, 510\n99, 30000\n7, [N/A]\n1234, 2\n"
    processes = parse_compute_apps(text)
    assert processes == {1234: 622.0, 1240: 510.0, 99: 30000.0}
    assert _gpu_shares(processes, [1234, 1240, 1300], 0) == (1132.0, None, 1132.0)
    assert _gpu_shares(processes, [1234], 99) == (622.0, 30000.0, 30622.0)
    # nvidia-smi names none of ours (another pid namespace): unknown, not zero.
    assert _gpu_shares(processes, [5, 6], 8) == (None, None, None)
    assert _gpu_shares(None, [1234], 99) == (None, None, None)


def test_gpu_memory_and_busy_from_nvidia_smi() -> None:
    # Two GPUs: memory adds up, utilisation is their mean; one that cannot say is left out.
    assert parse_gpu_reading("1000, 80\n500, 40\n") == (1500.0, 60.0)
    assert parse_gpu_reading("1000, [N/A]\n") == (1000.0, None)
    assert parse_gpu_reading("") is None
    assert parse_gpu_reading("[N/A], 5\n") is None


def _run(rate: float, **more: float | None) -> dict[str, float | None]:
    return {"samples_per_s": rate, "fairness": 1.0, "all_pss_mb": None,
            "daemon_peak_rss_mb": None, **more}  # fmt: skip


def _by_name(targets: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {target["name"]: target for target in targets}


def _find(targets: dict[str, dict[str, Any]], part: str) -> dict[str, Any]:
    (found,) = [target for name, target in targets.items() if part in name]
    return found


def test_the_gpu_targets() -> None:
    values = {
        "dali": {0: _run(10_000.0)},
        "dalid": {0: _run(9_850.0, handle_opens=6, handle_timed_opens=0, slabs=6)},
        "dali-qa": {0: _run(21_000.0)},
        "dalid-qa": {0: _run(18_500.0)},
        "dali-x8": {0: _run(10_000.0, all_gpu_mb=8 * 2000.0)},
        "dalid-x8": {0: _run(12_500.0, all_gpu_mb=7000.0)},
    }
    # One in-process job: 2,000 MiB, of which 500 its context (a dalid trainer's 500); one
    # dalid job: 2,700 (daemon and trainer); eight: 7,000, so each job past the first adds
    # 4,300 / 7 - 500 = 114 MiB beyond its context, 7.6% of the 1,500 an in-process job adds.
    values["dali"][0]["all_gpu_mb"] = 2000.0
    values["dalid"][0].update(all_gpu_mb=2700.0, trainers_gpu_mb=500.0)
    targets = _by_name(all_targets(values, {}, LABELS, gpu=True))
    one = targets["dalid (shared), 1 job: samples/s / DALI in-process, 1 job"]
    assert one["goal"] == ">= 98%" and one["met"] is True
    assert targets["dalid, QA configuration: samples/s"]["met"] is False
    assert targets["DALI in-process, QA configuration: samples/s"]["met"] is True
    eight = targets["dalid (shared), 8 jobs: samples/s / DALI in-process, 8 jobs (GPU)"]
    assert eight["measured"]["median"] == pytest.approx(1.25) and eight["met"] is True
    memory = _find(targets, "8 jobs: GPU memory of all processes / DALI in-process, 8 jobs")
    assert memory["measured"]["median"] == pytest.approx(7000 / 16000) and memory["met"] is True
    added = _find(targets, "GPU memory each job past the first adds")
    assert added["measured"]["median"] == pytest.approx((4300 / 7 - 500) / 1500)
    assert added["met"] is True
    # A daemon that adds a whole in-process job's worth per job misses it.
    values["dalid-x8"][0]["all_gpu_mb"] = 2700.0 + 7 * 2000.0
    worse = _find(_by_name(all_targets(values, {}, LABELS, gpu=True)), "past the first adds")
    assert worse["measured"]["median"] == pytest.approx(1.0) and worse["met"] is False
    values["dalid-x8"][0]["all_gpu_mb"] = 7000.0
    handles = _find(targets, "1 job: slab handles opened / slabs of its pool (each opened once)")
    assert handles["met"] is True
    later = targets["dalid (shared), 1 job: slab handles opened after the warm-up epoch"]
    assert later["met"] is True
    table = "\n".join(targets_table({"targets": list(targets.values())}))
    assert "| dalid, QA configuration: samples/s | >= 19,000 | 18,500 samples/s | **no** |" in table
    # On the CPU the GPU targets are not set, and one job is held to 97% (the hot path's goal).
    cpu = _by_name(all_targets(values, {}, LABELS))
    assert "dalid, QA configuration: samples/s" not in cpu
    assert cpu["dalid (shared), 1 job: samples/s / DALI in-process, 1 job"]["goal"] == ">= 97%"


def test_a_handle_opened_late_or_twice_misses_its_target() -> None:
    values = {
        "dalid": {
            0: _run(1.0, handle_opens=7, handle_timed_opens=1, slabs=6),
            1: _run(1.0, handle_opens=6, handle_timed_opens=0, slabs=6),
        }
    }
    targets = _by_name(all_targets(values, {}, LABELS))
    per_slab = _find(targets, "1 job: slab handles opened / slabs of its pool (each opened once)")
    assert per_slab["met"] is False  # the median of 7/6 and 6/6 is over 1
    later = targets["dalid (shared), 1 job: slab handles opened after the warm-up epoch"]
    assert later["met"] is False  # one repeat opened one
    uncounted = all_targets({"dalid": {0: _run(1.0)}}, {}, LABELS)
    assert not [target for target in uncounted if "handles" in target["name"]]
