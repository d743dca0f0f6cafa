"""The report's cohort section: the cohort runs, and where each run's PSS is by role."""

from __future__ import annotations

from typing import Any

from bench import cohort_report
from bench.memory import ROLE_FIGURES, ROLES


def _row(kind: str, jobs: int, roles: dict[str, dict[str, float]] | None) -> dict[str, Any]:
    memory: dict[str, dict[str, float]] = {"all_pss_mb": {"median": 1000.0, "n": 1}}
    for role in ROLES:
        for figure in ROLE_FIGURES:
            value = (roles or {}).get(role, {}).get(figure)
            memory[f"role_{role}_{figure}"] = (
                {"median": value, "n": 1} if value is not None else {"n": 0}
            )
    return {
        "id": f"{kind}-x{jobs}",
        "kind": kind,
        "jobs": jobs,
        "samples_per_s": {"median": 900.0, "min": 890.0, "max": 910.0, "n": 3},
        "memory": memory,
    }


def _report(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ratios = {"dalid-cohort-x4": {"dali-x4": {"median": 3.2, "min": 3.1, "max": 3.3, "n": 3}}}
    return {"summary": {"rows": rows, "ratios": ratios}}


WORKERS = {"processes": 8, "pss_mb": 561.0, "anon_mb": 523.0, "file_mb": 38.0, "shmem_mb": 0.0}
DAEMON = {"processes": 1, "pss_mb": 447.0, "anon_mb": 313.0, "file_mb": 42.0, "shmem_mb": 73.0}


def test_the_section_gives_each_roles_pss_and_its_split() -> None:
    rows = [
        _row("dali", 4, {"trainer": {**WORKERS, "processes": 4}}),
        _row("dalid-cohort", 4, {"worker": WORKERS, "daemon": DAEMON}),
        _row("dalid", 2, {"worker": WORKERS}),  # another job count: not the cohort's
    ]
    text = "\n".join(cohort_report.markdown(_report(rows)))
    assert "| 4 | dalid (cohort) | 900 [890-910] | 320 [310-330]% | 1,000 |" in text
    assert "| 4 | dalid (cohort) | worker | 8 | 561 | 523 | 38 | 0 |" in text
    assert "| 4 | dalid (cohort) | daemon | 1 | 447 | 313 | 42 | 73 |" in text
    assert "| 4 | DALI in-process | trainer | 4 | 561 |" in text
    # Roles that ran no process are left out, and so are the runs at other job counts.
    assert "| other |" not in text
    assert "| 2 |" not in text


def test_no_cohort_run_no_section_and_old_results_no_split() -> None:
    assert cohort_report.markdown(_report([_row("dali", 4, {"trainer": WORKERS})])) == []
    text = cohort_report.markdown(_report([_row("dalid-cohort", 4, None)]))
    assert any("| 4 | dalid (cohort) |" in line for line in text)
    assert not any("| worker |" in line or "Where each run" in line for line in text)
