"""Preflight: record the machine, software and inputs a matrix run depends on.

Nothing here imports torch, vllm or megatron: Python-side facts come from ``_probe.py`` run in
the target interpreter as a subprocess, hardware facts from ``nvidia-smi``/``rocminfo``/
``rocm-smi`` and repository state from ``git``. Missing tools and packages are recorded as
missing, timeouts as timeouts; nothing here needs a GPU or raises for an absent one. Parsers are
pure functions over captured text. gfx archs are only ever taken from what the runtime reports,
never inferred from a product name.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pytest_rlkernel_matrix.machine.nvidia import parse_nvidia_query, parse_nvidia_smi_L, parse_topo
from pytest_rlkernel_matrix.machine.rocm import build_rocm_section, parse_rocm_smi, parse_rocminfo
from pytest_rlkernel_matrix.store.redact import is_secret

__all__ = [
    "SCHEMA_VERSION",
    "collect_preflight",
    "detect_hardware",
    "fingerprint",
    "fingerprint_model_dir",
    "parse_nvidia_query",
    "parse_nvidia_smi_L",
    "parse_rocm_smi",
    "parse_rocminfo",
    "parse_topo",
    "run_command",
    "save_probe",
]

SCHEMA_VERSION = "rlkernel.preflight.v1"
# Test-suite only: a probe file written by `save_probe` that the plugin reuses instead of running
# the ~4 s interpreter probe again (the project's own tests share one per test session). Never
# set outside tests unless you mean it; preflight.json then says `probe.reused`.
REUSE_PROBE_ENV = "RLK_REUSE_PROBE"
PROBE_SCRIPT = Path(__file__).with_name("_probe.py")
# Runs the probe file with neither the cwd nor this package's directory on sys.path.
PROBE_BOOTSTRAP = (
    "import runpy, sys; sys.path[:] = [p for p in sys.path if p]; "
    "runpy.run_path(sys.argv[1], run_name='__main__')"
)
REPO_VARS: tuple[tuple[str, str], ...] = (
    ("vime", "VIME_ROOT"),
    ("rl_kernel", "RL_KERNEL_ROOT"),
    ("megatron", "MEGATRON_ROOT"),
)
# name -> argv; commands of one tool are skipped once that tool has timed out.
COMMANDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("nvidia-smi-L", ("nvidia-smi", "-L")),
    ("nvidia-smi-topo", ("nvidia-smi", "topo", "-m")),
    (
        "nvidia-smi-query",
        ("nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"),
    ),
    ("rocminfo", ("rocminfo",)),
    ("rocm-smi", ("rocm-smi",)),
    (
        "rocm-smi-info",
        ("rocm-smi", "--showproductname", "--showdriverversion", "--showmeminfo", "vram"),
    ),
    ("hipconfig-version", ("hipconfig", "--version")),
)
ENV_NAMES = frozenset(
    {
        "PYTHONPATH",
        "CUDA_VISIBLE_DEVICES",
        "HIP_VISIBLE_DEVICES",
        "ROCR_VISIBLE_DEVICES",
        "CUDA_DEVICE_MAX_CONNECTIONS",
        "CUDA_HOME",
        "ROCM_HOME",
        "ROCM_PATH",
        "HIP_PATH",
        "PYTORCH_ROCM_ARCH",
        "TORCH_CUDA_ARCH_LIST",
        "PYTHON_BIN",
        "VIME_ROOT",
        "RL_KERNEL_ROOT",
        "MEGATRON_ROOT",
    }
)
ENV_PREFIXES = ("RL_KERNEL_", "NCCL_", "RCCL_", "HSA_", "VLLM_", "MATRIX_")
CONTENT_SUFFIXES = frozenset(
    {".json", ".model", ".txt", ".tiktoken", ".yaml", ".yml", ".jinja", ".vocab", ".spm"}
)
CONTENT_MAX_BYTES = 64 << 20
SKIP_DIRS = frozenset({".git", "__pycache__", ".cache", ".ipynb_checkpoints"})
FINGERPRINT_METHOD = (
    "sha256 over sorted relative paths; content of *.json/tokenizer/text files "
    f"(suffix in {sorted(CONTENT_SUFFIXES)}, <= {CONTENT_MAX_BYTES} bytes), "
    "name + size of every other file (weights, .distcp, .metadata)"
)


# --------------------------------------------------------------------------- commands


def _tail(text: str, limit: int = 2000) -> str:
    return text if len(text) <= limit else "..." + text[-limit:]


def run_command(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = 60.0,
    raw_path: Path | None = None,
) -> tuple[dict[str, Any], str]:
    """Run ``argv`` without a shell; return (record, stdout).

    ``record["status"]`` is ``ok``, ``failed`` (non-zero exit), ``missing``, ``timeout`` or
    ``error``. The whole process group is killed on timeout. ``raw_path`` gets the raw stdout.
    """
    environ = dict(os.environ if env is None else env)
    record: dict[str, Any] = {"argv": list(argv), "status": "missing", "returncode": None}
    exe = argv[0]
    if os.sep not in exe and shutil.which(exe, path=environ.get("PATH", os.defpath)) is None:
        return record, ""
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            list(argv),
            env=environ,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
    except FileNotFoundError:
        return record, ""
    except OSError as exc:
        record.update(status="error", error=f"{type(exc).__name__}: {exc}")
        return record, ""
    try:
        out_b, err_b = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out_b, err_b = proc.communicate()
        record["status"] = "timeout"
        record["timeout_s"] = timeout
    stdout = out_b.decode("utf-8", "replace")
    stderr = err_b.decode("utf-8", "replace")
    record["duration_s"] = round(time.monotonic() - start, 3)
    if record["status"] != "timeout":
        record["returncode"] = proc.returncode
        record["status"] = "ok" if proc.returncode == 0 else "failed"
    if stderr.strip():
        record["stderr"] = _tail(stderr)
    if raw_path is not None:
        raw_path.parent.mkdir(parents=True, exist_ok=True)
        raw_path.write_text(stdout, encoding="utf-8")
        record["raw"] = str(raw_path)
    return record, stdout


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError, OSError):
        proc.kill()


# --------------------------------------------------------------------------- parsers


# --------------------------------------------------------------------------- sections


def build_gpu_section(
    nvidia: Mapping[str, Any], rocm: Mapping[str, Any], torch_info: Mapping[str, Any]
) -> dict[str, Any]:
    """Unified view: backend cuda|rocm|cpu from the tools first, torch second."""
    torch_devices = list(torch_info.get("devices") or [])
    torch_names = [str(d["name"]) for d in torch_devices if d.get("name")]
    backend, source, names = "cpu", "none", []
    if nvidia.get("gpus"):
        backend, source, names = "cuda", "nvidia-smi", [g["name"] for g in nvidia["gpus"]]
    elif rocm.get("gpu_agents"):
        gpus = [a for a in rocm["agents"] if a.get("device_type") == "GPU"]
        backend, source = "rocm", "rocminfo"
        names = [a.get("marketing_name") or a.get("name") or "" for a in gpus]
    elif rocm.get("smi") and rocm["smi"].get("devices"):
        backend, source = "rocm", "rocm-smi"
        names = [d.get("product") or "" for d in rocm["smi"]["devices"]]
    elif torch_names:
        backend = "rocm" if torch_info.get("hip") else "cuda"
        source, names = "torch", torch_names
    torch_count = int(torch_info.get("device_count") or 0)
    return {
        "backend": backend,
        "source": source,
        "count": len(names),
        "names": names,
        "torch_names": torch_names,
        "torch_device_count": torch_count,
        "torch_build": torch_info.get("build"),
        "torch_sees_all": torch_count == len(names) if names else None,
    }


_AXES = {
    "tp": ("tp", "tensor_model_parallel_size", "tensor_parallel_size"),
    "cp": ("cp", "context_parallel_size"),
    "pp": ("pp", "pipeline_model_parallel_size", "pipeline_parallel_size"),
    "ep": ("ep", "expert_model_parallel_size", "expert_parallel_size"),
}


def check_topology(topology: Mapping[str, object] | None, gpu_count: int) -> dict[str, Any]:
    """``gpus_needed = tp*cp*pp`` against the detected GPU count (EP lives inside DP)."""
    if topology is None:
        return {"configured": False}
    lowered = {str(k).lower(): v for k, v in topology.items()}
    sizes: dict[str, int] = {}
    for axis, aliases in _AXES.items():
        raw = next((lowered[a] for a in aliases if a in lowered), 1)
        if isinstance(raw, bool) or not isinstance(raw, int | str) or not str(raw).isdigit():
            return {"configured": True, "ok": False, "reason": f"{axis}={raw!r} is not an int"}
        sizes[axis] = int(raw)
    needed = sizes["tp"] * sizes["cp"] * sizes["pp"]
    check: dict[str, Any] = {"configured": True, **sizes, "gpus_needed": needed}
    check["gpus_available"] = gpu_count
    check["colocate"] = lowered.get("colocate")
    if gpu_count == 0:
        check.update(ok=False, reason="no GPU detected")
    else:
        check["ok"] = gpu_count >= needed
        check["divides"] = gpu_count % needed == 0 if needed else False
        if not check["ok"]:
            check["reason"] = f"needs {needed} GPUs (tp*cp*pp), {gpu_count} detected"
    return check


def fingerprint_model_dir(path: Path) -> dict[str, Any]:
    """Fingerprint a checkpoint/tokenizer dir or file; see ``FINGERPRINT_METHOD``."""
    path = Path(path)
    info: dict[str, Any] = {
        "path": str(path),
        "exists": path.exists(),
        "method": FINGERPRINT_METHOD,
    }
    if not path.exists():
        return info
    files = [path] if path.is_file() else sorted(_walk(path))
    digest = hashlib.sha256()
    content = sized = total = 0
    for file in files:
        rel = file.name if path.is_file() else file.relative_to(path).as_posix()
        size = file.stat().st_size
        total += size
        digest.update(rel.encode() + b"\0")
        if file.suffix.lower() in CONTENT_SUFFIXES and size <= CONTENT_MAX_BYTES:
            digest.update(b"C" + hashlib.sha256(file.read_bytes()).digest())
            content += 1
        else:
            digest.update(b"S" + str(size).encode() + b"\0")
            sized += 1
    info.update(
        sha256=digest.hexdigest(),
        files_content_hashed=content,
        files_name_and_size=sized,
        total_bytes=total,
    )
    return info


def _walk(root: Path) -> Iterable[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
        for name in filenames:
            file = Path(dirpath, name)
            if file.is_file():
                yield file


def _visible_devices(env: Mapping[str, str], backend: str) -> dict[str, Any] | None:
    """The ``*_VISIBLE_DEVICES`` restriction that applies to ``backend``, if any is set."""
    names = {
        "cuda": ("CUDA_VISIBLE_DEVICES",),
        "rocm": ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"),
    }.get(backend, ())
    for name in names:
        if name in env:
            ids = [i for i in env[name].split(",") if i.strip()]
            return {"var": name, "value": env[name], "count": len(ids)}
    return None


def _selected_env(env: Mapping[str, str]) -> dict[str, str]:
    return {
        k: v
        for k, v in sorted(env.items())
        if (k in ENV_NAMES or k.startswith(ENV_PREFIXES)) and not is_secret(k)
    }


# --------------------------------------------------------------------------- collect


def _run_probe(
    python: str, env: Mapping[str, str], timeout: float, raw_dir: Path | None
) -> dict[str, Any]:
    raw = raw_dir / "probe.txt" if raw_dir is not None else None
    record, stdout = run_command(
        [python, "-c", PROBE_BOOTSTRAP, str(PROBE_SCRIPT)], env=env, timeout=timeout, raw_path=raw
    )
    result: dict[str, Any] = {"status": record["status"], "command": record}
    if record["status"] != "ok":
        return result
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            try:
                result.update(json.loads(line))
            except json.JSONDecodeError as exc:
                result.update(status="error", error=f"bad probe JSON: {exc}")
            return result
    result.update(status="error", error="probe printed no JSON")
    return result


def save_probe(
    path: Path, *, python: str = sys.executable, env: Mapping[str, str] | None = None,
    timeout: float = 60.0,
) -> Path:
    """Run the interpreter probe once and write its result to `path` for `collect_preflight`'s
    `reuse_probe` (the test suite's shared probe). Written atomically; returns `path`."""
    environ = dict(os.environ if env is None else env)
    environ.pop(REUSE_PROBE_ENV, None)
    probe = _run_probe(python, environ, timeout, None)
    probe["probed_at"] = datetime.now(UTC).isoformat(timespec="seconds")
    probe["requested_python"] = python
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(probe, indent=1, sort_keys=True, default=str), encoding="utf-8")
    os.replace(tmp, path)
    return path


def _reused_probe(path: Path, python: str) -> tuple[dict[str, Any] | None, str | None]:
    """(probe, None) from a `save_probe` file made with this interpreter, else (None, why)."""
    try:
        saved = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return None, f"{path}: unreadable ({exc})"
    if not isinstance(saved, dict) or "probed_at" not in saved:
        return None, f"{path}: not a probe written by save_probe"
    want = os.path.abspath(shutil.which(python) or python)
    got = (saved.get("python") or {}).get("executable")
    if got is None or os.path.abspath(str(got)) != want:
        return None, f"{path}: probed {got}, not {want}"
    probe = {k: v for k, v in saved.items() if k not in ("probed_at", "requested_python")}
    probe["reused"] = {"from": str(path), "probed_at": saved["probed_at"],
                       "note": f"{REUSE_PROBE_ENV} set: the interpreter probe was not run for "
                       "this session; its result was copied from an earlier probe"}
    return probe, None


def _repo_state(
    name: str, root: str | None, env: Mapping[str, str], timeout: float, raw_dir: Path | None
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    if not root:
        return {"configured": False}, {}
    state: dict[str, Any] = {"configured": True, "root": root, "commit": None, "dirty": None}
    cmds: dict[str, dict[str, Any]] = {}
    for key, args in (("head", ("rev-parse", "HEAD")), ("status", ("status", "--porcelain"))):
        cname = f"git-{name}-{key}"
        raw = raw_dir / f"{cname}.txt" if raw_dir is not None else None
        rec, out = run_command(["git", "-C", root, *args], env=env, timeout=timeout, raw_path=raw)
        cmds[cname] = rec
        if rec["status"] != "ok":
            state.setdefault("status", rec["status"])
            state.setdefault("error", rec.get("stderr", rec["status"]))
            continue
        if key == "head":
            state["commit"] = out.strip() or None
        else:
            state["dirty"] = bool(out.strip())
            state["changed_files"] = len(out.strip().splitlines())
    state.setdefault("status", "ok")
    return state, cmds


def collect_preflight(
    *,
    python: str = sys.executable,
    env: Mapping[str, str] | None = None,
    raw_dir: Path | None = None,
    checkpoint: Path | None = None,
    tokenizer: Path | None = None,
    topology: Mapping[str, object] | None = None,
    timeout: float = 60.0,
    reuse_probe: Path | None = None,
) -> dict[str, object]:
    """Collect the preflight record (JSON-serialisable); never raises for missing tools.

    `reuse_probe`: a `save_probe` file to take the interpreter probe from instead of running it
    (the test suite's shared probe); the record says so in `probe.reused`. A file that is
    unreadable or from another interpreter is not used: the probe runs and `probe.reuse_refused`
    says why.
    """
    environ: dict[str, str] = dict(os.environ if env is None else env)
    raw = Path(raw_dir) if raw_dir is not None else None
    if raw is not None:
        raw.mkdir(parents=True, exist_ok=True)
    probe, refused = _reused_probe(reuse_probe, python) if reuse_probe else (None, None)
    if probe is None:
        probe = _run_probe(python, environ, timeout, raw)
        if refused:
            probe["reuse_refused"] = refused
    commands: dict[str, dict[str, Any]] = {}
    outputs: dict[str, str] = {name: "" for name, _ in COMMANDS}
    timed_out: set[str] = set()
    for name, argv in COMMANDS:
        if argv[0] in timed_out:
            commands[name] = {
                "argv": list(argv),
                "status": "skipped",
                "returncode": None,
                "reason": f"{argv[0]} timed out earlier",
            }
            continue
        rec, out = run_command(
            argv, env=environ, timeout=timeout, raw_path=raw / f"{name}.txt" if raw else None
        )
        commands[name] = rec
        if rec["status"] == "timeout":
            timed_out.add(argv[0])
        # Non-zero exits may still print usable tables (rocm-smi warnings); parsers are lenient.
        outputs[name] = out if rec["status"] in ("ok", "failed") else ""
    repos: dict[str, dict[str, Any]] = {}
    for name, var in REPO_VARS:
        repos[name], cmds = _repo_state(name, environ.get(var), environ, timeout, raw)
        repos[name]["env"] = var
        commands.update(cmds)

    query = parse_nvidia_query(outputs["nvidia-smi-query"])
    nvidia = {
        "available": commands["nvidia-smi-L"]["status"] == "ok",
        "gpus": parse_nvidia_smi_L(outputs["nvidia-smi-L"]),
        "query": query,
        "driver": query[0]["driver_version"] if query else None,
        "topology": parse_topo(outputs["nvidia-smi-topo"]) if outputs["nvidia-smi-topo"] else None,
    }
    torch_info: dict[str, Any] = dict(probe.get("torch") or {})
    rl_engine: dict[str, Any] = dict(probe.get("rl_engine") or {})
    smi = parse_rocm_smi(outputs["rocm-smi"] + "\n" + outputs["rocm-smi-info"])
    rocm = build_rocm_section(
        parse_rocminfo(outputs["rocminfo"]) if outputs["rocminfo"] else None,
        smi if smi["devices"] or smi["driver"] else None,
        torch_info.get("devices") or [],
        environ.get("PYTORCH_ROCM_ARCH"),
        rl_engine.get("ext_offload_archs") or [],
    )
    if outputs["hipconfig-version"].strip():
        rocm["hip_version"] = outputs["hipconfig-version"].strip().splitlines()[-1]
    gpu = build_gpu_section(nvidia, rocm, torch_info)
    gpu["visible"] = _visible_devices(environ, str(gpu["backend"]))
    usable = gpu["visible"]["count"] if gpu["visible"] else gpu["count"]
    py = probe.get("python") or {}
    result: dict[str, object] = {
        "schema_version": SCHEMA_VERSION,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "python": {
            "requested": python,
            "version": py.get("version"),
            "executable": py.get("executable"),
        },
        "probe": probe,
        "commands": commands,
        "repos": repos,
        "env": _selected_env(environ),
        "nvidia": nvidia,
        "rocm": rocm,
        "gpu": gpu,
        "topology": dict(topology) if topology is not None else None,
        "topology_check": check_topology(topology, min(int(usable), int(gpu["count"]))),
        "checkpoint": fingerprint_model_dir(checkpoint) if checkpoint is not None else None,
        "tokenizer": fingerprint_model_dir(tokenizer) if tokenizer is not None else None,
    }
    hw, build = fingerprint(result)
    result["fingerprints"] = {"hardware": hw, "build": build}
    return result


# --------------------------------------------------------------------------- matching


def _get(obj: object, name: str) -> Any:
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        return obj.get(name)
    return getattr(obj, name, None)


def _section(preflight: Mapping[str, object], name: str) -> Mapping[str, Any]:
    value = preflight.get(name)
    return value if isinstance(value, Mapping) else {}


def _gfx_archs(preflight: Mapping[str, object]) -> list[str]:
    return [str(a) for a in _section(preflight, "rocm").get("runtime_gfx_archs") or []]


def detect_hardware(preflight: Mapping[str, object], profiles: Mapping[str, object]) -> str | None:
    """First profile (mapping order) whose backend and every given matcher fit this machine."""
    gpu = _section(preflight, "gpu")
    backend = str(gpu.get("backend") or "cpu")
    count = int(gpu.get("count") or 0)
    nvidia_names = [str(g.get("name")) for g in _section(preflight, "nvidia").get("gpus") or []]
    device_names = nvidia_names + [str(n) for n in gpu.get("torch_names") or []]
    rocm_agents = _section(preflight, "rocm").get("agents") or []
    marketing = [
        str(a.get("marketing_name"))
        for a in rocm_agents
        if a.get("device_type") == "GPU" and a.get("marketing_name")
    ]
    archs = set(_gfx_archs(preflight))
    for name, profile in profiles.items():
        want = _get(profile, "backend")
        want = str(getattr(want, "value", want) or "").lower()
        if want != backend or (want == "cpu" and count):
            continue
        match = _get(profile, "match")
        device_re = _get(match, "device_name")
        marketing_re = _get(match, "marketing_name")
        gfx = _get(match, "gfx_arch")
        if device_re and not any(re.search(device_re, n, re.IGNORECASE) for n in device_names):
            continue
        if marketing_re and not any(re.search(marketing_re, n, re.IGNORECASE) for n in marketing):
            continue
        if gfx:
            wanted = {gfx.lower()} if isinstance(gfx, str) else {str(g).lower() for g in gfx}
            if not wanted & archs:
                continue
        return str(name)
    return None


def _short(payload: object) -> str:
    blob = json.dumps(payload, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def fingerprint(preflight: Mapping[str, object]) -> tuple[str, str]:
    """(hardware, build) fingerprints: 16-hex sha256 prefixes of the identifying facts."""
    gpu = _section(preflight, "gpu")
    nvidia = _section(preflight, "nvidia")
    rocm = _section(preflight, "rocm")
    hardware = {
        "backend": gpu.get("backend") or "cpu",
        "names": sorted(str(n) for n in gpu.get("names") or []),
        "count": int(gpu.get("count") or 0),
        "driver": nvidia.get("driver") or rocm.get("driver"),
        "gfx_archs": sorted(_gfx_archs(preflight)),
    }
    probe = _section(preflight, "probe")
    torch_info = probe.get("torch") or {}
    packages = probe.get("packages") or {}
    repos = _section(preflight, "repos")
    build = {
        "torch": torch_info.get("version"),
        "cuda": torch_info.get("cuda"),
        "hip": torch_info.get("hip"),
        "rl_engine_ext_sha256": (probe.get("rl_engine") or {}).get("ext_sha256"),
        "vllm": (packages.get("vllm") or {}).get("version"),
        "megatron_core": (packages.get("megatron-core") or {}).get("version"),
        "repos": {
            k: [v.get("commit"), v.get("dirty")]
            for k, v in sorted(repos.items())
            if isinstance(v, Mapping)
        },
    }
    return _short(hardware), _short(build)
