"""Tests for ``pytest_rlkernel_matrix.machine.preflight``: parsers on captured outputs, hardware
detection, fingerprints and ``collect_preflight`` against real subprocesses (fake tools on PATH).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pytest_rlkernel_matrix.machine import preflight as pf

DATA = Path(__file__).parent / "data" / "preflight"
REPO_ROOT = Path(__file__).resolve().parents[1]
NO_PYTHON = "/nonexistent/bin/python3"  # skips the (slow) probe where it is not under test
CAT = shutil.which("cat") or "/bin/cat"
SLEEP = shutil.which("sleep") or "/bin/sleep"

PROFILES: dict[str, object] = {
    "h100": SimpleNamespace(backend="cuda", match=SimpleNamespace(device_name=r"H100")),
    "h200": SimpleNamespace(
        backend="cuda", match=SimpleNamespace(device_name=r"\bH200\b", marketing_name=None)
    ),
    "mi300x": SimpleNamespace(
        backend="rocm",
        match=SimpleNamespace(marketing_name=r"MI300X", gfx_arch=["gfx942"], device_name=None),
    ),
    "mi355x": {"backend": "rocm", "match": {"gfx_arch": ["gfx950"]}},
    "cpu": SimpleNamespace(backend="cpu", match=None),
}


def read(name: str) -> str:
    return (DATA / name).read_text(encoding="utf-8")


def make_tool(bindir: Path, name: str, body: str) -> Path:
    bindir.mkdir(parents=True, exist_ok=True)
    tool = bindir / name
    tool.write_text("#!/bin/sh\n" + body + "\n", encoding="utf-8")
    tool.chmod(0o755)
    return tool


def fake_nvidia(bindir: Path, gpus: str = "h100x8") -> None:
    make_tool(
        bindir,
        "nvidia-smi",
        f"""case "$1" in
  -L) exec {CAT} "{DATA}/nvidia-smi-L.{gpus}.txt" ;;
  topo) exec {CAT} "{DATA}/nvidia-smi-topo.h100x8.txt" ;;
  --query-gpu=*) exec {CAT} "{DATA}/nvidia-smi-query.{gpus}.txt" ;;
  *) echo "unsupported: $*" >&2; exit 2 ;;
esac""",
    )


def fake_rocm(bindir: Path, gpu: str = "mi300x") -> None:
    make_tool(bindir, "rocminfo", f'exec {CAT} "{DATA}/rocminfo.{gpu}.txt"')
    if gpu != "mi300x":
        return  # rocm-smi captures exist for MI300X only
    make_tool(
        bindir,
        "rocm-smi",
        f"""if [ $# -eq 0 ]; then exec {CAT} "{DATA}/rocm-smi.mi300x.txt"; fi
exec {CAT} "{DATA}/rocm-smi-info.mi300x.txt\"""",
    )


def collect(bindir: Path, **kwargs: Any) -> dict[str, Any]:
    bindir.mkdir(parents=True, exist_ok=True)
    env = {"PATH": str(bindir), "HOME": str(bindir), **kwargs.pop("extra_env", {})}
    kwargs.setdefault("python", NO_PYTHON)
    result = pf.collect_preflight(env=env, **kwargs)
    json.dumps(result)  # must be JSON-serialisable
    return result


# --------------------------------------------------------------------------- parsers


def test_parse_nvidia_smi_L_h100_and_h200() -> None:
    gpus = pf.parse_nvidia_smi_L(read("nvidia-smi-L.h100x8.txt"))
    assert [g["index"] for g in gpus] == list(range(8))
    assert {g["name"] for g in gpus} == {"NVIDIA H100 80GB HBM3"}
    assert all(g["uuid"].startswith("GPU-") for g in gpus)
    (h200,) = pf.parse_nvidia_smi_L(read("nvidia-smi-L.h200x1.txt"))
    assert h200["name"] == "NVIDIA H200"


def test_parse_nvidia_smi_L_variants() -> None:
    text = (
        "GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-aaaa)\n"
        "  MIG 3g.40gb     Device  0: (UUID: MIG-bbbb)\n"
        "GPU 1: Tesla V100-SXM2-32GB\n"
        "No devices were found\n"
    )
    gpus = pf.parse_nvidia_smi_L(text)
    assert gpus[0]["mig"] == [{"profile": "3g.40gb", "index": 0, "uuid": "MIG-bbbb"}]
    assert gpus[1] == {"index": 1, "name": "Tesla V100-SXM2-32GB", "uuid": None, "mig": []}
    assert pf.parse_nvidia_smi_L("") == []


def test_parse_nvidia_query() -> None:
    rows = pf.parse_nvidia_query(read("nvidia-smi-query.h100x8.txt"))
    assert len(rows) == 8
    assert rows[0] == {
        "name": "NVIDIA H100 80GB HBM3",
        "memory_total": "81559 MiB",
        "memory_total_mib": 81559,
        "driver_version": "550.54.15",
    }


def test_parse_topo_h100() -> None:
    topo = pf.parse_topo(read("nvidia-smi-topo.h100x8.txt"))
    assert topo["gpus"] == [f"GPU{i}" for i in range(8)]
    assert topo["devices"][-1] == "NIC3"
    assert len(topo["rows"]) == 12
    gpu0 = topo["rows"][0]
    assert gpu0["name"] == "GPU0" and gpu0["links"]["GPU0"] == "X"
    assert {gpu0["links"][f"GPU{i}"] for i in range(1, 8)} == {"NV18"}
    assert gpu0["links"]["NIC0"] == "PIX"
    assert gpu0["cpu_affinity"] == "0-55,112-167"
    assert gpu0["numa_affinity"] == "0" and gpu0["gpu_numa_id"] == "N/A"
    assert topo["rows"][7]["numa_affinity"] == "1"
    nic = topo["rows"][-1]
    assert nic["name"] == "NIC3" and nic["cpu_affinity"] is None
    assert topo["legend"]["NV#"].startswith("Connection traversing a bonded set")
    assert topo["nics"]["NIC2"] == "mlx5_2"


def test_parse_topo_space_separated_without_nics() -> None:
    text = (
        "        GPU0    GPU1    CPU Affinity    NUMA Affinity\n"
        "GPU0     X      NV12    0-31            N/A\n"
        "GPU1    NV12     X      0-31            N/A\n"
    )
    topo = pf.parse_topo(text)
    assert topo["gpus"] == ["GPU0", "GPU1"]
    assert topo["rows"][1]["links"] == {"GPU0": "NV12", "GPU1": "X"}
    assert topo["rows"][1]["cpu_affinity"] == "0-31"
    assert topo["legend"] == {} and topo["nics"] == {}
    assert pf.parse_topo("")["rows"] == []


@pytest.mark.parametrize(
    ("name", "gfx", "marketing", "cus"),
    [
        ("rocminfo.mi300x.txt", "gfx942", "AMD Instinct MI300X", 304),
        ("rocminfo.mi355x.txt", "gfx950", "AMD Instinct MI355X", 256),
    ],
)
def test_parse_rocminfo(name: str, gfx: str, marketing: str, cus: int) -> None:
    info = pf.parse_rocminfo(read(name))
    assert info["runtime_version"] == "1.14" and info["rock_module_version"] == "6.8.5"
    agents = info["agents"]
    assert [a["device_type"] for a in agents] == ["CPU", "CPU"] + ["GPU"] * 8
    cpu = agents[0]
    assert cpu["name"].startswith("AMD EPYC") and cpu["gfx_arch"] is None and cpu["isa"] == []
    gpu = agents[2]
    assert gpu["name"] == gfx and gpu["gfx_arch"] == gfx
    assert gpu["marketing_name"] == marketing and gpu["compute_units"] == cus
    assert gpu["isa"] == [f"amdgcn-amd-amdhsa--{gfx}:sramecc+:xnack-"]
    assert [a["node"] for a in agents[2:]] == list(range(2, 10))


def test_parse_rocminfo_arch_from_isa_when_name_is_not_gfx() -> None:
    text = (
        "Agent 1\n  Name: some-gpu\n  Device Type: GPU\n"
        "  ISA Info:\n    ISA 1\n      Name: amdgcn-amd-amdhsa--gfx90a:sramecc+:xnack-\n"
    )
    (agent,) = pf.parse_rocminfo(text)["agents"]
    assert agent["gfx_arch"] == "gfx90a" and agent["marketing_name"] is None
    assert pf.parse_rocminfo("")["agents"] == []


def test_parse_rocm_smi_table_and_info() -> None:
    table = pf.parse_rocm_smi(read("rocm-smi.mi300x.txt"))
    assert [d["index"] for d in table["devices"]] == list(range(8))
    dev = table["devices"][5]
    assert dev["temp"] == "36.0°C" and dev["partitions"] == "NPS1, SPX, 0"
    assert dev["pwrcap"] == "750.0W" and dev["vram_pct"] == "0%" and dev["gpu_pct"] == "0%"
    both = pf.parse_rocm_smi(read("rocm-smi.mi300x.txt") + read("rocm-smi-info.mi300x.txt"))
    assert both["driver"] == "6.8.5"
    dev = both["devices"][0]
    assert dev["product"] == "AMD Instinct MI300X OAM" and dev["gfx_arch"] == "gfx942"
    assert dev["vram_total_bytes"] == 206141652992 and dev["perf"] == "manual"


def test_parse_rocm_smi_legacy_table() -> None:
    smi = pf.parse_rocm_smi(read("rocm-smi.legacy-mi250x.txt"))
    assert smi["driver"] is None and len(smi["devices"]) == 2
    assert smi["devices"][1]["temp_dieedge"] == "33.0c"
    assert smi["devices"][1]["pwrcap"] == "560.0W"
    assert pf.parse_rocm_smi("") == {"driver": None, "devices": []}


# --------------------------------------------------------------------------- ROCm arch


def test_build_arch_mismatch_reported() -> None:
    info = pf.parse_rocminfo(read("rocminfo.mi300x.txt"))
    ok = pf.build_rocm_section(info, None, [], "gfx90a;gfx942")
    assert ok["runtime_gfx_archs"] == ["gfx942"] and ok["build_arch_mismatch"] == []
    bad = pf.build_rocm_section(info, None, [], "gfx90a")
    assert bad["build_arch_mismatch"] == ["gfx942"]
    unset = pf.build_rocm_section(info, None, [], None)
    assert unset["pytorch_rocm_arch"] is None and unset["build_arch_mismatch"] is None
    torch_only = pf.build_rocm_section(None, None, [{"gcnArchName": "gfx950:sramecc+"}], "gfx942")
    assert torch_only["runtime_gfx_archs"] == ["gfx950"]
    assert torch_only["build_arch_mismatch"] == ["gfx950"]
    ext = pf.build_rocm_section(info, None, [], None, ["gfx90a"])
    assert ext["ext_arch_mismatch"] == ["gfx942"]


def test_collect_rocm_mi355x_arch_mismatch(tmp_path: Path) -> None:
    bindir = tmp_path / "bin"
    fake_rocm(bindir, "mi355x")
    result = collect(bindir, extra_env={"PYTORCH_ROCM_ARCH": "gfx942"})
    rocm = result["rocm"]
    assert rocm["runtime_gfx_archs"] == ["gfx950"]
    assert rocm["pytorch_rocm_arch"] == "gfx942" and rocm["build_arch_mismatch"] == ["gfx950"]
    assert result["env"]["PYTORCH_ROCM_ARCH"] == "gfx942"
    assert result["gpu"]["backend"] == "rocm" and result["gpu"]["count"] == 8
    assert detect_hardware(result) == "mi355x"


# --------------------------------------------------------------------------- detect_hardware


def detect_hardware(
    result: dict[str, Any], profiles: Mapping[str, object] | None = None
) -> str | None:
    return pf.detect_hardware(result, PROFILES if profiles is None else profiles)


def test_detect_hardware_h100_h200(tmp_path: Path) -> None:
    fake_nvidia(tmp_path / "h100", "h100x8")
    fake_nvidia(tmp_path / "h200", "h200x1")
    h100 = collect(tmp_path / "h100")
    h200 = collect(tmp_path / "h200")
    assert detect_hardware(h100) == "h100"
    assert detect_hardware(h200) == "h200"
    only_rocm = {"mi300x": PROFILES["mi300x"], "cpu": PROFILES["cpu"]}
    assert detect_hardware(h100, only_rocm) is None
    assert pf.fingerprint(h100)[0] != pf.fingerprint(h200)[0]


def test_detect_hardware_mi300x_by_marketing_name_and_gfx(tmp_path: Path) -> None:
    fake_rocm(tmp_path / "bin", "mi300x")
    result = collect(tmp_path / "bin")
    assert detect_hardware(result) == "mi300x"
    smi = result["rocm"]["smi"]
    assert smi["driver"] == "6.8.5" and len(smi["devices"]) == 8
    assert smi["devices"][0]["product"] == "AMD Instinct MI300X OAM"
    assert result["rocm"]["driver"] == "6.8.5"
    assert result["gpu"]["names"] == ["AMD Instinct MI300X"] * 8
    by_name = {"x": {"backend": "rocm", "match": {"marketing_name": r"instinct mi300x"}}}
    assert detect_hardware(result, by_name) == "x"
    # An MI300X marketing name with a different arch must not match: archs are never guessed.
    wrong_arch = {
        "x": {"backend": "rocm", "match": {"marketing_name": "MI300X", "gfx_arch": ["gfx950"]}}
    }
    assert detect_hardware(result, wrong_arch) is None
    assert detect_hardware(result, {"x": {"backend": "cuda", "match": {}}}) is None


def test_detect_hardware_cpu_and_none(tmp_path: Path) -> None:
    result = collect(tmp_path / "empty")
    assert result["gpu"]["backend"] == "cpu" and result["gpu"]["count"] == 0
    assert detect_hardware(result) == "cpu"
    assert detect_hardware(result, {"h100": PROFILES["h100"]}) is None
    gpu_machine = {"gpu": {"backend": "cuda", "count": 1}, "nvidia": {"gpus": [{"name": "X"}]}}
    assert pf.detect_hardware(gpu_machine, {"cpu": PROFILES["cpu"]}) is None


def test_detect_hardware_first_match_in_order() -> None:
    machine = {
        "gpu": {"backend": "cuda", "count": 1},
        "nvidia": {"gpus": [{"name": "NVIDIA H100"}]},
    }
    profiles = {"any-cuda": {"backend": "cuda", "match": None}, "h100": PROFILES["h100"]}
    assert pf.detect_hardware(machine, profiles) == "any-cuda"
    assert pf.detect_hardware(machine, dict(reversed(profiles.items()))) == "h100"


# --------------------------------------------------------------------------- collect_preflight


def test_missing_tools_recorded_as_missing(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    result = collect(
        tmp_path / "empty",
        python=sys.executable,
        raw_dir=raw,
        extra_env={"VIME_ROOT": str(tmp_path)},
        topology={"tp": 2, "cp": 2},
    )
    commands = result["commands"]
    for name in ("nvidia-smi-L", "nvidia-smi-topo", "rocminfo", "rocm-smi", "git-vime-head"):
        assert commands[name]["status"] == "missing" and commands[name]["returncode"] is None
    assert commands["nvidia-smi-topo"]["argv"] == ["nvidia-smi", "topo", "-m"]
    assert result["repos"]["vime"]["configured"] is True
    assert (
        result["repos"]["vime"]["status"] == "missing" and result["repos"]["vime"]["commit"] is None
    )
    assert result["repos"]["rl_kernel"] == {"configured": False, "env": "RL_KERNEL_ROOT"}
    assert result["nvidia"]["available"] is False and result["nvidia"]["topology"] is None
    assert result["rocm"]["available"] is False and result["rocm"]["build_arch_mismatch"] is None
    assert result["gpu"] == {
        "visible": None,
        "backend": "cpu",
        "source": "none",
        "count": 0,
        "names": [],
        "torch_names": [],
        "torch_device_count": 0,
        "torch_build": result["probe"]["torch"]["build"],
        "torch_sees_all": None,
    }
    assert result["topology_check"]["ok"] is False
    assert result["topology_check"]["gpus_needed"] == 4
    # The probe ran in the target python even with an empty PATH.
    probe = result["probe"]
    assert probe["status"] == "ok" and probe["command"]["argv"][1] == "-c"
    assert result["python"]["executable"] == sys.executable
    assert result["python"]["version"] == sys.version
    assert probe["torch"]["installed"] is True and probe["torch"]["version"]
    assert probe["torch"]["device_count"] == 0
    assert probe["packages"]["vllm"]["version"] is None
    assert probe["packages"]["megatron-core"]["module_found"] is False
    assert probe["rl_engine"]["found"] is False and probe["rl_engine"]["importable"] is False
    assert (raw / "probe.txt").read_text().strip().splitlines()[-1].startswith("{")
    assert result["schema_version"] == pf.SCHEMA_VERSION and result["created"].endswith("+00:00")


def test_missing_python_recorded(tmp_path: Path) -> None:
    result = collect(tmp_path / "empty")
    assert result["probe"]["status"] == "missing"
    assert result["python"] == {"requested": NO_PYTHON, "version": None, "executable": None}


def test_fake_nvidia_tools(tmp_path: Path) -> None:
    bindir = tmp_path / "bin"
    fake_nvidia(bindir)
    raw = tmp_path / "raw"
    topology = {"tp": 2, "cp": 2, "pp": 1, "ep": 1, "colocate": True}
    result = collect(bindir, raw_dir=raw, topology=topology)
    commands = result["commands"]
    assert (
        commands["nvidia-smi-L"]["status"] == "ok" and commands["nvidia-smi-L"]["returncode"] == 0
    )
    assert commands["rocminfo"]["status"] == "missing"
    assert (raw / "nvidia-smi-L.txt").read_text() == read("nvidia-smi-L.h100x8.txt")
    assert (raw / "nvidia-smi-topo.txt").read_text() == read("nvidia-smi-topo.h100x8.txt")
    nvidia = result["nvidia"]
    assert len(nvidia["gpus"]) == 8 and nvidia["driver"] == "550.54.15"
    assert len(nvidia["topology"]["rows"]) == 12
    gpu = result["gpu"]
    assert (gpu["backend"], gpu["source"], gpu["count"]) == ("cuda", "nvidia-smi", 8)
    check = result["topology_check"]
    assert check["ok"] is True and check["gpus_needed"] == 4 and check["divides"] is True
    assert result["topology"] == topology
    too_big = pf.check_topology({"TP": 4, "cp": 4}, 8)
    assert too_big["ok"] is False and too_big["gpus_needed"] == 16
    assert pf.check_topology({"tp": "two"}, 8)["ok"] is False
    limited = collect(bindir, topology=topology, extra_env={"CUDA_VISIBLE_DEVICES": "0,1"})
    assert limited["gpu"]["visible"] == {"var": "CUDA_VISIBLE_DEVICES", "value": "0,1", "count": 2}
    assert limited["topology_check"]["ok"] is False
    assert limited["topology_check"]["gpus_available"] == 2
    assert pf.check_topology(None, 8) == {"configured": False}


def test_failing_and_timed_out_commands(tmp_path: Path) -> None:
    bindir = tmp_path / "bin"
    make_tool(bindir, "nvidia-smi", f"exec {SLEEP} 30")
    make_tool(bindir, "rocminfo", "echo 'ROCk module is NOT loaded' >&2; exit 1")
    start = time.monotonic()
    result = collect(bindir, timeout=1.0)
    assert time.monotonic() - start < 15
    commands = result["commands"]
    assert commands["nvidia-smi-L"]["status"] == "timeout"
    assert commands["nvidia-smi-L"]["returncode"] is None
    assert commands["nvidia-smi-topo"]["status"] == "skipped"
    assert commands["rocminfo"]["status"] == "failed" and commands["rocminfo"]["returncode"] == 1
    assert "NOT loaded" in commands["rocminfo"]["stderr"]
    assert result["gpu"]["backend"] == "cpu"


def git(root: Path, *args: str) -> str:
    cmd = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@example.com", *args]
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()


@pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")
def test_repo_commit_and_dirty(tmp_path: Path) -> None:
    repo = tmp_path / "vime"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "train.py").write_text("print('hi')\n")
    git(repo, "add", "train.py")
    git(repo, "commit", "-q", "-m", "init")
    head = git(repo, "rev-parse", "HEAD")
    env = {**os.environ, "VIME_ROOT": str(repo), "RL_KERNEL_ROOT": str(tmp_path / "not-a-repo")}
    env.pop("MEGATRON_ROOT", None)
    (tmp_path / "not-a-repo").mkdir()
    clean: dict[str, Any] = pf.collect_preflight(
        python=NO_PYTHON, env=env, raw_dir=tmp_path / "raw"
    )
    vime = clean["repos"]["vime"]
    assert vime["commit"] == head and vime["dirty"] is False and vime["status"] == "ok"
    assert (tmp_path / "raw" / "git-vime-head.txt").read_text().strip() == head
    rlk = clean["repos"]["rl_kernel"]
    assert rlk["configured"] is True and rlk["commit"] is None and rlk["status"] == "failed"
    assert clean["repos"]["megatron"]["configured"] is False
    (repo / "scratch.txt").write_text("x")
    dirty: dict[str, Any] = pf.collect_preflight(python=NO_PYTHON, env=env)
    assert dirty["repos"]["vime"]["dirty"] is True and dirty["repos"]["vime"]["changed_files"] == 1
    assert pf.fingerprint(clean)[1] != pf.fingerprint(dirty)[1]
    assert pf.fingerprint(clean)[0] == pf.fingerprint(dirty)[0]


# --------------------------------------------------------------------------- fingerprints


def make_checkpoint(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"model_type": "qwen3", "num_hidden_layers": 36}))
    (root / "generation_config.json").write_text("{}")
    (root / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0}}}))
    (root / "tokenizer_config.json").write_text("{}")
    index = {"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    (root / "model-00001-of-00002.safetensors").write_bytes(b"\x01" * 1000)
    (root / "model-00002-of-00002.safetensors").write_bytes(b"\x02" * 500)
    return root


def test_checkpoint_fingerprint(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt")
    first = pf.fingerprint_model_dir(ckpt)
    assert first["exists"] is True and len(first["sha256"]) == 64
    assert first["files_content_hashed"] == 5 and first["files_name_and_size"] == 2
    assert first["total_bytes"] > 1500 and "name + size" in first["method"]
    # Same-size weight rewrite: unchanged by design (weights are name+size only).
    (ckpt / "model-00001-of-00002.safetensors").write_bytes(b"\x03" * 1000)
    assert pf.fingerprint_model_dir(ckpt)["sha256"] == first["sha256"]
    (ckpt / "model-00001-of-00002.safetensors").write_bytes(b"\x03" * 1001)
    resized = pf.fingerprint_model_dir(ckpt)["sha256"]
    assert resized != first["sha256"]
    (ckpt / "config.json").write_text(json.dumps({"model_type": "qwen3", "num_hidden_layers": 28}))
    assert pf.fingerprint_model_dir(ckpt)["sha256"] not in (first["sha256"], resized)
    # Location independent.
    shutil.copytree(ckpt, tmp_path / "copy")
    copy = pf.fingerprint_model_dir(tmp_path / "copy")
    assert copy["sha256"] == pf.fingerprint_model_dir(ckpt)["sha256"]
    missing = pf.fingerprint_model_dir(tmp_path / "nope")
    assert missing["exists"] is False and "sha256" not in missing


def test_collect_with_checkpoint_and_tokenizer(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt")
    result = collect(tmp_path / "bin", checkpoint=ckpt, tokenizer=tmp_path / "missing-tok")
    assert result["checkpoint"]["sha256"] == pf.fingerprint_model_dir(ckpt)["sha256"]
    assert result["tokenizer"]["exists"] is False
    assert collect(tmp_path / "bin")["checkpoint"] is None


def test_fingerprint_shape_and_determinism(tmp_path: Path) -> None:
    fake_nvidia(tmp_path / "bin")
    first = collect(tmp_path / "bin")
    second = collect(tmp_path / "bin")
    hw, build = pf.fingerprint(first)
    assert (hw, build) == pf.fingerprint(second)
    assert first["fingerprints"] == {"hardware": hw, "build": build}
    assert len(hw) == len(build) == 16 and int(hw, 16) >= 0 and int(build, 16) >= 0
    changed = json.loads(json.dumps(first))
    changed["probe"]["rl_engine"] = {"ext_sha256": "ab" * 32}
    assert pf.fingerprint(changed) == (hw, pf.fingerprint(changed)[1])
    assert pf.fingerprint(changed)[1] != build
    assert pf.fingerprint({}) == pf.fingerprint({"gpu": {"backend": "cpu"}})


# --------------------------------------------------------------------------- import hygiene


def test_import_does_not_pull_torch() -> None:
    code = (
        "import sys, pytest_rlkernel_matrix.machine.preflight\n"
        "heavy = [m for m in ('torch', 'vllm', 'megatron', 'numpy') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr


def test_probe_runs_as_module() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pytest_rlkernel_matrix.machine._probe"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    assert data["python"]["executable"] == sys.executable
    assert set(data["packages"]) >= {"vllm", "vllm-router", "megatron-core", "flash-attn", "triton"}
    assert data["torch"]["build"] in {"cpu", "cuda", "rocm"}


def test_probe_reports_rl_engine_extension_and_megatron_source(tmp_path: Path) -> None:
    site = tmp_path / "site"
    (site / "rl_engine").mkdir(parents=True)
    (site / "rl_engine" / "__init__.py").write_text('__version__ = "0.3.1"\n')
    ext = site / "rl_engine" / "_C.py"
    ext.write_text("# offload bundle: hipv4-amdgcn-amd-amdhsa--gfx942\nLOADED = True\n")
    (site / "megatron" / "core").mkdir(parents=True)
    (site / "megatron" / "core" / "package_info.py").write_text(
        "MAJOR = 0\nMINOR = 13\nPATCH = 0\nPRE_RELEASE = 'rc0'\n"
    )
    (tmp_path / "bin").mkdir()
    env = {"PATH": str(tmp_path / "bin"), "PYTHONPATH": str(site)}
    result: dict[str, Any] = pf.collect_preflight(env=env)
    rl = result["probe"]["rl_engine"]
    assert rl["importable"] is True and rl["version"] == "0.3.1" and rl["ext_loaded"] is True
    assert rl["ext_file"] == str(ext)
    assert rl["ext_sha256"] == hashlib.sha256(ext.read_bytes()).hexdigest()
    assert rl["ext_offload_archs"] == ["gfx942"]
    megatron = result["probe"]["packages"]["megatron-core"]
    assert megatron["module_found"] is True and megatron["version"] == "0.13.0rc0"
    ext.write_text("raise ImportError('undefined symbol: _ZN3c10')\n")
    broken: dict[str, Any] = pf.collect_preflight(env=env)
    rl = broken["probe"]["rl_engine"]
    assert rl["importable"] is True and rl["ext_loaded"] is False
    assert "undefined symbol" in rl["ext_error"]
    assert rl["ext_sha256"] == hashlib.sha256(ext.read_bytes()).hexdigest()
    assert pf.fingerprint(broken)[1] != pf.fingerprint(result)[1]


def test_real_h200_preflight_recorded_through_the_device_tool() -> None:
    """tests/data/preflight/h200-device: `rlk-matrix preflight` on one lent H200 (2026-11-29)."""
    from pytest_rlkernel_matrix.spec.matrix import load_matrix

    folder = Path(__file__).parent / "data" / "preflight" / "h200-device"
    data = json.loads((folder / "preflight.json").read_text())
    assert data["gpu"]["backend"] == "cuda" and data["gpu"]["names"] == ["NVIDIA H200"]
    assert data["probe"]["torch"]["version"].startswith("2.11.0")
    matrix = load_matrix(Path(__file__).parents[1] / "matrix.toml")
    assert pf.detect_hardware(data, matrix.hardware) == "h200"
    hw, build = pf.fingerprint(data)
    assert (hw, build) == pf.fingerprint(json.loads(json.dumps(data)))  # stable
    gpus = pf.parse_nvidia_smi_L((folder / "nvidia-smi-L.txt").read_text())
    assert [g["name"] for g in gpus] == ["NVIDIA H200"]
    topo = pf.parse_topo((folder / "nvidia-smi-topo.txt").read_text())
    assert topo["gpus"] == ["GPU0"] or topo.get("devices")


def test_reused_probe_is_marked_and_refused_when_it_does_not_fit(tmp_path: Path) -> None:
    """RLK_REUSE_PROBE's file: used only for the interpreter it probed, and always labelled."""
    saved = {"status": "ok", "probed_at": "2026-01-01T00:00:00+00:00",
             "requested_python": sys.executable, "python": {"executable": sys.executable},
             "torch": {"version": "2.13.0+cpu"}}
    good = tmp_path / "probe.json"
    good.write_text(json.dumps(saved))
    probe, why = pf._reused_probe(good, sys.executable)
    assert why is None and probe is not None
    assert probe["reused"]["from"] == str(good) and "not run" in probe["reused"]["note"]
    assert "probed_at" not in probe and probe["torch"] == {"version": "2.13.0+cpu"}
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**saved, "python": {"executable": "/elsewhere/python3"}}))
    assert pf._reused_probe(other, sys.executable) == (
        None, f"{other}: probed /elsewhere/python3, not {os.path.abspath(sys.executable)}")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert "unreadable" in str(pf._reused_probe(bad, sys.executable)[1])
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"status": "ok"}))
    assert "not a probe written by save_probe" in str(pf._reused_probe(bare, sys.executable)[1])
    # A refused file never stands in for the probe: the real one runs (here: a missing python).
    result = pf.collect_preflight(python=NO_PYTHON, env={"PATH": ""}, reuse_probe=other)
    assert result["probe"]["status"] == "missing"
    assert "probed /elsewhere/python3" in result["probe"]["reuse_refused"]
    assert "reused" not in result["probe"]
