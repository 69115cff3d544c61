"""Tests for ``pytest_rlkernel_matrix.machine.capability``: captured probe outputs and the
real probe.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pytest_rlkernel_matrix.judge.decide import UNSUPPORTED_CLASSES
from pytest_rlkernel_matrix.machine import preflight as pf
from pytest_rlkernel_matrix.machine.capability import (
    R_MODULES,
    STATUSES,
    capability_report,
    r_provider_for_command,
    requested_r_blockers,
)

DATA = Path(__file__).parent / "data" / "capability"
KEYS = (
    "transformer_engine", "custom_all_reduce", "ipc", "peer_access", "graph", "collectives",
    "attention.sdpa_flash", "attention.sdpa_mem_efficient", "attention.sdpa_math",
    "attention.flash_attn", "gemm", "rl_engine.extension",
    "r_backend.attention", "r_backend.ffn", "r_backend.logp",
)


def load(name: str) -> dict[str, Any]:
    return json.loads((DATA / name).read_text(encoding="utf-8"))


def statuses(report: dict[str, Any]) -> dict[str, str]:
    return {k: e["status"] for k, e in report["capabilities"].items()}


def check_shape(report: dict[str, Any]) -> None:
    json.dumps(report)  # stored in preflight.json
    caps = report["capabilities"]
    assert set(KEYS) <= set(caps)
    for entry in caps.values():
        assert {"name", "status", "check", "reason", "platform"} <= set(entry)
        assert entry["status"] in STATUSES
        assert entry["check"] and entry["reason"]
        if entry["status"] == "unavailable":
            assert entry["unsupported_class"] in UNSUPPORTED_CLASSES
        else:
            assert "unsupported_class" not in entry
    assert sum(report["summary"].values()) == len(caps)


def test_real_probe_on_this_machine() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", pf.PROBE_BOOTSTRAP, str(pf.PROBE_SCRIPT)],
        capture_output=True, text=True, timeout=300, check=True,
    )
    probe = json.loads(proc.stdout.strip().splitlines()[-1])
    raw = probe["capabilities_raw"]
    assert raw["seconds"] < 5  # ~0.1 s on CPU; loose bound for loaded CI machines
    report = capability_report(probe, "cpu")
    check_shape(report)
    caps = report["capabilities"]
    if not raw["gpu"]:
        assert report["platform"] == "cpu"
        for key in ("graph", "ipc", "collectives", "attention.sdpa_flash"):
            assert caps[key]["status"] == "unavailable"
            assert caps[key]["reason"] == "no GPU"
        assert caps["peer_access"]["status"] == "unavailable"
        assert caps["attention.sdpa_math"]["status"] == "verified"
    for module in R_MODULES:
        assert caps[f"r_backend.{module}"]["status"] == "verified", caps[f"r_backend.{module}"]
    assert caps["gemm"]["status"] == "verified"
    assert requested_r_blockers(report, R_MODULES) == []


def test_h200_real_capture() -> None:
    report = capability_report(load("h200-cu130.probe.json"), "cuda")
    check_shape(report)
    assert report["platform"] == "cuda" and report["gpu_count"] == 1
    got = statuses(report)
    assert got == {
        "transformer_engine": "unavailable", "custom_all_reduce": "unavailable",
        "ipc": "verified", "peer_access": "untested", "graph": "verified",
        "collectives": "verified", "attention.sdpa_flash": "verified",
        "attention.sdpa_mem_efficient": "verified", "attention.sdpa_math": "verified",
        "attention.sdpa_cudnn": "verified", "attention.flash_attn": "unavailable",
        "gemm": "verified", "rl_engine.extension": "unavailable",
        "r_backend.attention": "verified", "r_backend.ffn": "verified",
        "r_backend.logp": "verified",
    }
    caps = report["capabilities"]
    assert [caps[k]["name"] for k in ("ipc", "graph", "collectives")] == [
        "CUDA IPC", "CUDA Graph", "NCCL"]
    assert "2.28.9" in caps["collectives"]["reason"]
    assert "1 visible" in caps["peer_access"]["reason"]
    assert caps["gemm"]["details"]["library"] == "cuBLAS"
    assert caps["rl_engine.extension"]["unsupported_class"] == "platform_unsupported"


def test_h200_one_gpu_with_vllm_custom_all_reduce_is_untested() -> None:
    probe = load("h200-cu130.probe.json")
    probe["capabilities_raw"]["custom_all_reduce"] = {
        "module": "vllm._custom_ops", "found": True, "importable": True,
        "has_init_custom_ar": True, "communicator_found": True,
    }
    entry = capability_report(probe, "cuda")["capabilities"]["custom_all_reduce"]
    assert entry["status"] == "untested"
    assert ">= 2 GPUs, 1 visible" in entry["reason"]


def test_mi300x_rocm_names_and_gaps() -> None:
    probe = load("mi300x-rocm6.3.probe.json")
    report = capability_report(probe, "rocm")
    check_shape(report)
    caps = report["capabilities"]
    assert report["platform"] == "rocm"
    assert caps["ipc"]["name"] == "HIP IPC" and caps["ipc"]["status"] == "verified"
    assert caps["peer_access"]["name"] == "HIP peer memory"
    assert caps["peer_access"]["status"] == "verified"
    assert caps["graph"]["name"] == "HIP Graph" and caps["graph"]["status"] == "verified"
    assert caps["collectives"]["name"] == "RCCL" and caps["collectives"]["status"] == "verified"
    assert "RCCL 2.21.5" in caps["collectives"]["reason"]
    assert caps["gemm"]["name"] == "hipBLAS/hipBLASLt GEMM"
    assert caps["gemm"]["details"]["library"] == "hipBLASLt"
    te = caps["transformer_engine"]
    assert te["status"] == "unavailable" and "not assumed on ROCm" in te["reason"]
    car = caps["custom_all_reduce"]
    assert car["status"] == "unavailable"
    assert car["unsupported_class"] == "communication_path_unsupported"
    assert "attention.sdpa_cudnn" not in caps  # a cuDNN backend is never assumed on ROCm
    assert caps["attention.flash_attn"]["status"] == "verified"
    assert caps["rl_engine.extension"]["status"] == "verified"
    names = " ".join(e["name"] for k, e in caps.items() if k != "custom_all_reduce")
    assert "CUDA" not in names and "NCCL" not in names and "cuBLAS" not in names
    for entry in caps.values():
        assert entry["platform"] == "rocm"


def test_mi300x_extension_without_runtime_gfx_is_a_build_failure() -> None:
    preflight = {
        "probe": {"status": "ok", **load("mi300x-rocm6.3.probe.json")},
        "rocm": {"ext_arch_mismatch": ["gfx942"]},
    }
    preflight["probe"]["rl_engine"]["ext_offload_archs"] = ["gfx90a"]
    entry = capability_report(preflight, "rocm")["capabilities"]["rl_engine.extension"]
    assert entry["status"] == "unavailable" and entry["unsupported_class"] == "build_failure"
    assert "gfx942" in entry["reason"] and "gfx90a" in entry["reason"]


def test_mi300x_rl_engine_registry() -> None:
    report = capability_report(load("mi300x-rocm6.3.probe.json"), "rocm", r_provider="rl_engine")
    caps = report["capabilities"]
    assert caps["r_backend.attention"]["status"] == "untested"  # declared, not exercised
    assert "declares" in caps["r_backend.attention"]["reason"]
    ffn = caps["r_backend.ffn"]
    assert ffn["status"] == "unavailable" and ffn["unsupported_class"] == "platform_unsupported"
    assert "rocm" in ffn["reason"]
    assert requested_r_blockers(report, ["attention", "ffn", "logp"]) == [
        ("platform_unsupported", f"ffn R backend ({ffn['name']}): {ffn['reason']}")
    ]


def test_rl_engine_extension_fails_to_load() -> None:
    probe = load("cpu-rl-engine-ext-broken.probe.json")
    report = capability_report(probe, "cpu", r_provider="rl_engine")
    check_shape(report)
    caps = report["capabilities"]
    ext = caps["rl_engine.extension"]
    assert ext["status"] == "unavailable" and ext["unsupported_class"] == "build_failure"
    assert "undefined symbol" in ext["reason"]
    blockers = requested_r_blockers(report, ["logp", "attention", "logp"])
    assert [cls for cls, _ in blockers] == ["build_failure", "build_failure"]
    assert blockers[0][1].startswith("logp R backend") and "undefined symbol" in blockers[0][1]
    # the reference workload's own R kernels are unaffected by a broken rl_engine
    assert requested_r_blockers(capability_report(probe, "cpu"), R_MODULES) == []


def test_rl_engine_not_installed_blocks_rl_engine_r() -> None:
    report = capability_report(load("cpu.probe.json"), "cpu", r_provider="rl_engine")
    blockers = requested_r_blockers(report, ["attention"])
    assert blockers == [("platform_unsupported", blockers[0][1])]
    assert "rl_engine not installed" in blockers[0][1]


def test_requested_r_blockers_only_counts_unavailable() -> None:
    report = capability_report(load("h200-cu130.probe.json"), "cuda")
    assert requested_r_blockers(report, R_MODULES) == []
    assert requested_r_blockers(report, []) == []
    broken = copy.deepcopy(load("h200-cu130.probe.json"))
    broken["capabilities_raw"]["workload_r"]["ffn"] = {"ok": False, "max_abs_err": 0.3}
    broken["capabilities_raw"]["workload_r"]["logp"] = {
        "ok": False, "error": "RuntimeError: CUDA error: no kernel image is available"}
    report = capability_report(broken, "cuda")
    assert requested_r_blockers(report, ["attention", "ffn", "logp"]) == [
        ("contract_unsatisfied", requested_r_blockers(report, ["ffn"])[0][1]),
        ("platform_unsupported", requested_r_blockers(report, ["logp"])[0][1]),
    ]
    # works on the bare capabilities mapping as stored under preflight.json's `capabilities`
    assert requested_r_blockers(report["capabilities"], ["ffn"]) == requested_r_blockers(
        report, ["ffn"])
    untested = {"capabilities": {"r_backend.ffn": {"status": "untested"}}}
    assert requested_r_blockers(untested, ["ffn", "attention"]) == []


def test_gpu_profile_without_gpu_blocks_workload_r() -> None:
    report = capability_report(load("cpu.probe.json"), "cuda")
    assert report["notes"] == ["profile backend is cuda but torch is a cpu build"]
    blockers = requested_r_blockers(report, ["attention"])
    assert blockers and blockers[0][0] == "platform_unsupported"
    assert "saw no GPU" in blockers[0][1]
    rocm = capability_report(load("cpu.probe.json"), "rocm")
    assert rocm["capabilities"]["graph"]["name"] == "HIP Graph"


@pytest.mark.parametrize(
    "preflight",
    [
        {"probe": {"status": "timeout", "command": {}}},
        {"probe": {"status": "ok", "torch": {}}},
        {"probe": {"status": "ok", "capabilities_raw": {"error": "RuntimeError: boom"}}},
    ],
)
def test_probe_without_capabilities_is_all_untested(preflight: dict[str, Any]) -> None:
    report = capability_report(preflight, "cuda")
    check_shape(report)
    assert set(statuses(report).values()) == {"untested"}
    assert requested_r_blockers(report, R_MODULES) == []


def test_crashed_check_is_untested_not_missing() -> None:
    probe = load("h200-cu130.probe.json")
    probe["capabilities_raw"]["nccl"] = {"ok": False, "error": "RuntimeError: boom"}
    probe["capabilities_raw"]["transformer_engine"] = {"ok": False, "error": "OSError: x"}
    caps = capability_report(probe, "cuda")["capabilities"]
    assert caps["collectives"]["status"] == "untested" and "boom" in caps["collectives"]["reason"]
    assert caps["transformer_engine"]["status"] == "untested"


def test_r_provider_for_command() -> None:
    assert r_provider_for_command(
        '"$PYTHON_BIN" -m pytest_rlkernel_matrix.workload --preset tiny') == "workload"
    assert r_provider_for_command('bash "$VIME_ROOT/scripts/run.sh"') == "rl_engine"


def test_real_h200_preflight_with_capabilities() -> None:
    """`rlk-matrix preflight --r-provider workload` on one lent H200 (2026-11-29), as recorded."""
    path = Path(__file__).parent / "data" / "capability" / "h200-preflight-capabilities.json"
    caps = json.loads(path.read_text())["capabilities"]["capabilities"]
    assert caps["graph"]["status"] == "verified" and caps["ipc"]["status"] == "verified"
    assert caps["peer_access"]["status"] == "untested"  # one GPU
    assert caps["collectives"]["name"] == "NCCL"
    assert {caps[f"r_backend.{m}"]["status"] for m in ("attention", "ffn", "logp")} == {"verified"}
    assert caps["rl_engine.extension"]["status"] == "unavailable"
