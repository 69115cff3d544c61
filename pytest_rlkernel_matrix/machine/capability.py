"""Capability report: what this machine really offers, each item verified, unavailable or untested.

Built from the ``capabilities_raw`` section the preflight probe (``_probe.py``, run in the target
interpreter as a subprocess) emits; nothing here imports torch. Under ROCm things are named for
what they are (HIP IPC, HIP Graph, RCCL, hipBLASLt) and CUDA-only features (CUDA custom
all-reduce) are never assumed. Every ``unavailable`` entry carries an ``unsupported_class`` from
``verdict.UNSUPPORTED_CLASSES``; ``requested_r_blockers`` turns the R-backend entries into the
reasons a strict cell fails before its job starts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

__all__ = [
    "R_MODULES",
    "SCHEMA_VERSION",
    "STATUSES",
    "capability_report",
    "r_provider_for_command",
    "requested_r_blockers",
]

SCHEMA_VERSION = "rlkernel.capabilities.v1"
STATUSES = ("verified", "unavailable", "untested")
R_MODULES = ("attention", "ffn", "logp")
RProvider = Literal["workload", "rl_engine"]

_NAMES: dict[str, dict[str, str]] = {
    "ipc": {"cuda": "CUDA IPC", "rocm": "HIP IPC", "cpu": "CUDA/HIP IPC"},
    "peer_access": {"cuda": "CUDA peer memory", "rocm": "HIP peer memory", "cpu": "peer memory"},
    "graph": {"cuda": "CUDA Graph", "rocm": "HIP Graph", "cpu": "CUDA/HIP Graph"},
    "collectives": {"cuda": "NCCL", "rocm": "RCCL", "cpu": "NCCL/RCCL"},
    "gemm": {"cuda": "cuBLAS/cuBLASLt GEMM", "rocm": "hipBLAS/hipBLASLt GEMM", "cpu": "CPU GEMM"},
}
_BLAS = {
    "cuda": {"cublas": "cuBLAS", "cublaslt": "cuBLASLt", "ck": "CK"},
    "rocm": {"cublas": "hipBLAS", "cublaslt": "hipBLASLt", "ck": "Composable Kernel"},
}
_SDPA = (
    ("flash", "flash_sdp_enabled", "SDPA flash attention"),
    ("mem_efficient", "mem_efficient_sdp_enabled", "SDPA memory-efficient attention"),
    ("math", "math_sdp_enabled", "SDPA math attention"),
    ("cudnn", "cudnn_sdp_enabled", "SDPA cuDNN attention"),
)


def _entry(
    name: str,
    status: str,
    check: str,
    reason: str,
    platform: str,
    unsupported_class: str | None = None,
    **details: Any,
) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "name": name,
        "status": status,
        "check": check,
        "reason": reason,
        "platform": platform,
    }
    if status == "unavailable":
        entry["unsupported_class"] = unsupported_class or "platform_unsupported"
    if details:
        entry["details"] = details
    return entry


def _map(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _probe_of(preflight: Mapping[str, Any]) -> tuple[Mapping[str, Any], str | None]:
    """(probe output, why it is unusable or None); accepts a preflight or a bare probe."""
    probe = _map(preflight.get("probe")) if "probe" in preflight else preflight
    if "probe" in preflight and probe.get("status") not in (None, "ok"):
        return probe, f"probe {probe.get('status')}: {probe.get('error', '')}".rstrip(": ")
    if not isinstance(probe.get("capabilities_raw"), Mapping):
        return probe, "probe reported no capabilities_raw (older probe?)"
    if "error" in probe["capabilities_raw"] and len(probe["capabilities_raw"]) == 1:
        return probe, f"capability probe failed: {probe['capabilities_raw']['error']}"
    return probe, None


def _platform(torch_info: Mapping[str, Any], profile_backend: str) -> str:
    """``rocm`` whenever torch is a HIP build (or the profile is ROCm); else cuda/cpu."""
    if torch_info.get("hip") or profile_backend == "rocm":
        return "rocm"
    if torch_info.get("cuda") or profile_backend == "cuda":
        return "cuda"
    return "cpu"


def _import_entry(
    name: str, raw: Mapping[str, Any], check: str, platform: str, missing_note: str = ""
) -> dict[str, Any]:
    module = raw.get("module", "?")
    if "found" not in raw:
        return _crashed(name, raw, check, platform)
    if raw.get("importable"):
        version = raw.get("version") or "unknown version"
        return _entry(name, "verified", check, f"{module} {version} imported", platform,
                      version=raw.get("version"))
    if raw.get("found"):
        return _entry(name, "unavailable", check, f"{module} found but fails to import: "
                      f"{raw.get('error', '?')}", platform, "build_failure")
    return _entry(name, "unavailable", check, f"{module} not installed{missing_note}", platform,
                  "platform_unsupported")


def _crashed(name: str, raw: Mapping[str, Any], check: str, platform: str) -> dict[str, Any]:
    why = f"the check itself failed: {raw['error']}" if raw.get("error") else "not run"
    return _entry(name, "untested", check, why, platform)


def _gpu_run(
    name: str, raw: Mapping[str, Any] | None, check: str, platform: str, gpu: bool,
    ok_reason: str, fail_class: str,
) -> dict[str, Any]:
    """Entry for a check that really ran on the GPU (``{ok, error}``)."""
    if not gpu:
        return _entry(name, "unavailable", check, "no GPU", platform, "platform_unsupported")
    if not raw:
        return _entry(name, "untested", check, "the probe did not run this check", platform)
    if raw.get("ok"):
        return _entry(name, "verified", check, ok_reason, platform)
    return _entry(name, "unavailable", check, str(raw.get("error") or "check failed"), platform,
                  fail_class)


def _transformer_engine(raw: Mapping[str, Any], platform: str) -> dict[str, Any]:
    check = "import transformer_engine and transformer_engine.pytorch; read __version__"
    note = " (TransformerEngine is not assumed on ROCm)" if platform == "rocm" else ""
    entry = _import_entry("TransformerEngine", _map(raw.get("transformer_engine")), check,
                          platform, note)
    if entry["status"] == "verified" and platform == "rocm":
        entry["reason"] += " (ROCm build)"
    return entry


def _custom_all_reduce(
    raw: Mapping[str, Any], platform: str, gpu: bool, count: int
) -> dict[str, Any]:
    name = "CUDA custom all-reduce (vLLM)"
    check = "import vllm._custom_ops (init_custom_ar); find vllm custom_all_reduce communicator"
    if platform == "rocm":
        return _entry(name, "unavailable", "none: CUDA-only feature, not checked on ROCm",
                      "CUDA-specific; not assumed on ROCm (vLLM's ROCm all-reduce paths differ)",
                      platform, "communication_path_unsupported")
    if not gpu:
        return _entry(name, "unavailable", check, "no GPU", platform, "platform_unsupported")
    car = _map(raw.get("custom_all_reduce"))
    if "found" not in car:
        return _crashed(name, car, check, platform)
    if not car.get("found"):
        return _entry(name, "unavailable", check, "vllm._custom_ops not installed", platform,
                      "communication_path_unsupported")
    if not car.get("importable"):
        return _entry(name, "unavailable", check, f"vllm._custom_ops fails to import: "
                      f"{car.get('error', '?')}", platform, "build_failure")
    if not car.get("has_init_custom_ar"):
        return _entry(name, "unavailable", check, "vllm._custom_ops has no init_custom_ar",
                      platform, "communication_path_unsupported")
    why = (f"importable; a real run needs >= 2 GPUs, {count} visible" if count < 2 else
           "importable; the probe runs no multi-process all-reduce: confirm it in the run log")
    return _entry(name, "untested", check, why, platform)


def _ipc(raw: Mapping[str, Any], platform: str, gpu: bool) -> dict[str, Any]:
    name = _NAMES["ipc"][platform]
    ipc = _map(raw.get("ipc"))
    check = ("torch.multiprocessing.reductions.reduce_tensor on cuda:0; a second process "
             "rebuilds the tensor and adds 1 in place")
    if not ipc.get("reductions_importable", True):
        return _entry(name, "unavailable", check, "torch.multiprocessing.reductions missing",
                      platform, "communication_path_unsupported")
    return _gpu_run(name, _map(ipc.get("same_device")) or None, check, platform, gpu,
                    "a second process wrote to a tensor shared from GPU 0 (same-device IPC; "
                    "cross-GPU peer memory is a separate entry)", "communication_path_unsupported")


def _peer(raw: Mapping[str, Any], platform: str, gpu: bool, count: int) -> dict[str, Any]:
    name = _NAMES["peer_access"][platform]
    check = "torch.cuda.can_device_access_peer for every GPU pair + a cuda:0 -> cuda:1 copy"
    if gpu and count < 2:
        return _entry(name, "untested", check, f"needs >= 2 GPUs, {count} visible", platform)
    entry = _gpu_run(name, _map(raw.get("peer_access")) or None, check, platform, gpu,
                     "every GPU pair reports peer access; cross-GPU copy matched",
                     "communication_path_unsupported")
    if entry["status"] == "unavailable" and _map(raw.get("peer_access")).get("pairs"):
        no = [k for k, v in raw["peer_access"]["pairs"].items() if not v]
        entry["reason"] = f"no peer access for {', '.join(no)}"
    return entry


def _collectives(raw: Mapping[str, Any], platform: str, gpu: bool) -> dict[str, Any]:
    name = _NAMES["collectives"][platform]
    nccl = _map(raw.get("nccl"))
    check = ("torch.distributed.is_nccl_available(), torch.cuda.nccl.version(), single-rank "
             "all_reduce through the nccl backend")
    if not gpu:
        return _entry(name, "unavailable", check, "no GPU", platform, "platform_unsupported")
    if "available" not in nccl:
        return _crashed(name, nccl, check, platform)
    version = nccl.get("version")
    if not nccl.get("available"):
        return _entry(name, "unavailable", check, f"torch is built without {name}", platform,
                      "communication_path_unsupported", version=version)
    if nccl.get("ok"):
        return _entry(name, "verified", check, f"{name} {version}: single-rank all_reduce ran; "
                      "multi-rank paths must be confirmed in the run log", platform,
                      version=version)
    return _entry(name, "unavailable", check, str(nccl.get("error") or "all_reduce failed"),
                  platform, "communication_path_unsupported", version=version)


def _sdpa(raw: Mapping[str, Any], platform: str, gpu: bool) -> dict[str, dict[str, Any]]:
    sdpa = _map(raw.get("sdpa"))
    flags, runs = _map(sdpa.get("flags")), _map(sdpa.get("runs"))
    out: dict[str, dict[str, Any]] = {}
    for key, flag, name in _SDPA:
        if key == "cudnn" and platform != "cuda":
            continue
        check = (f"torch.backends.cuda.{flag}(); scaled_dot_product_attention forced onto "
                 f"SDPBackend {key} on a tiny causal input")
        run = _map(runs.get(key))
        if not gpu and key != "math":
            out[key] = _entry(name, "unavailable", check, "no GPU", platform)
        elif flags.get(key) is False:
            out[key] = _entry(name, "unavailable", check, f"disabled: {flag}() is False", platform)
        elif not run:
            out[key] = _crashed(name, sdpa, check, platform)
        elif run.get("ok"):
            where = "cuda:0 (bf16)" if gpu else "cpu (fp32)"
            out[key] = _entry(name, "verified", check, f"ran on {where}, max abs err "
                              f"{run.get('max_abs_err', 0):.2g} vs float64", platform)
        else:
            out[key] = _entry(name, "unavailable", check,
                              str(run.get("error") or "result does not match float64"), platform)
    return out


def _gemm(raw: Mapping[str, Any], platform: str, gpu: bool) -> dict[str, Any]:
    gemm = _map(raw.get("gemm"))
    name = _NAMES["gemm"][platform if gpu else "cpu"]
    check = "torch.backends.cuda.preferred_blas_library(); tiny mm vs float64"
    if not gemm:
        return _entry(name, "untested", check, "the probe did not run this check", platform)
    lib = str(gemm.get("preferred_blas_library") or "").rsplit(".", 1)[-1].lower()
    library = _BLAS.get(platform, {}).get(lib, lib or None) if gpu else None
    if gemm.get("ok"):
        pref = f" (preferred: {library})" if library else ""
        return _entry(name, "verified", check, f"{gemm.get('dtype', '?')} mm on "
                      f"{gemm.get('device', '?')} matched float64{pref}", platform,
                      library=library)
    return _entry(name, "unavailable", check, str(gemm.get("error") or "mm result wrong"),
                  platform, "platform_unsupported", library=library)


def _extension(
    probe: Mapping[str, Any], preflight: Mapping[str, Any], platform: str
) -> dict[str, Any]:
    rl = _map(probe.get("rl_engine"))
    name = "RL-Kernel extension (rl_engine._C)"
    check = "import rl_engine, then rl_engine._C"
    if not rl.get("found"):
        return _entry(name, "unavailable", check, "rl_engine not installed", platform,
                      "platform_unsupported")
    if not rl.get("ext_loaded"):
        err = rl.get("ext_error") or rl.get("error") or "rl_engine._C did not load"
        return _entry(name, "unavailable", check, f"found but fails to load: {err}", platform,
                      "build_failure", ext_file=rl.get("ext_file"))
    mismatch = _map(preflight.get("rocm")).get("ext_arch_mismatch")
    if platform == "rocm" and mismatch:
        return _entry(name, "unavailable", check + "; compare its gfx targets with rocminfo",
                      f"loads, but has no code for runtime gfx {', '.join(mismatch)} "
                      f"(built for {', '.join(rl.get('ext_offload_archs') or []) or '?'})",
                      platform, "build_failure")
    return _entry(name, "verified", check, f"loaded from {rl.get('ext_file')}", platform,
                  sha256=rl.get("ext_sha256"), offload_archs=rl.get("ext_offload_archs"))


def _r_workload(raw: Mapping[str, Any], module: str, platform: str, gpu: bool,
                profile_backend: str) -> dict[str, Any]:
    wl = _map(raw.get("workload_r"))
    backend_id = _map(wl.get("backend_ids")).get(module, f"workload R {module}")
    name = f"R {module}: {backend_id} (reference workload)"
    check = (f"pytest_rlkernel_matrix.workload.kernels R {module} on a tiny input on the "
             "probe's device, compared with float64")
    if "torch_missing" in raw:
        return _entry(name, "unavailable", check, f"torch: {raw['torch_missing']}", platform,
                      "platform_unsupported")
    if profile_backend in ("cuda", "rocm") and not gpu:
        return _entry(name, "unavailable", check, f"profile is {profile_backend} but the "
                      "probe saw no GPU", platform, "platform_unsupported")
    if not wl:
        return _entry(name, "untested", check, "the probe did not run this check", platform)
    if wl.get("ok") is False:  # the kernels module itself failed to import
        return _entry(name, "unavailable", check, f"workload kernels: {wl.get('error')}",
                      platform, "build_failure")
    run = _map(wl.get(module))
    if run.get("ok"):
        return _entry(name, "verified", check, f"ran on {wl.get('device')}, max abs err "
                      f"{run.get('max_abs_err', 0):.2g} vs float64", platform,
                      provider="workload", backend_id=backend_id)
    if not run:
        return _entry(name, "untested", check, "the probe did not run this check", platform)
    if "error" in run:
        return _entry(name, "unavailable", check, str(run["error"]), platform,
                      "platform_unsupported")
    return _entry(name, "unavailable", check, f"result off by {run.get('max_abs_err')} vs "
                  "float64", platform, "contract_unsatisfied")


def _r_rl_engine(probe: Mapping[str, Any], raw: Mapping[str, Any], module: str,
                 platform: str) -> dict[str, Any]:
    rl = _map(probe.get("rl_engine"))
    reg = _map(raw.get("rl_engine_registry"))
    name = f"R {module}: RL-Kernel (rl_engine)"
    check = "rl_engine.runtime.registry.kernel_registry.semantic.backend_descriptors()"
    if not rl.get("found"):
        return _entry(name, "unavailable", check, "rl_engine not installed", platform,
                      "platform_unsupported")
    if not rl.get("importable") or rl.get("ext_error"):
        err = rl.get("error") or rl.get("ext_error")
        return _entry(name, "unavailable", check, f"rl_engine / rl_engine._C fails to load: "
                      f"{err}", platform, "build_failure")
    if not reg or reg.get("ok") is False:
        why = f": {reg['error']}" if reg.get("error") else ""
        return _entry(name, "untested", check, f"no readable rl_engine capability API{why}",
                      platform)
    info = _map(reg.get(module))
    desc = _map(info.get("descriptor"))
    if not desc:
        return _entry(name, "unavailable", check, f"no RL-Kernel backend registered for "
                      f"{info.get('semantic_op', module)} (has: {info.get('backend_ids')})",
                      platform, "platform_unsupported")
    devices = list(desc.get("supported_devices") or [])
    name = f"R {module}: {desc.get('backend_id')} (rl_engine)"
    if platform in devices or "*" in devices:
        return _entry(name, "untested", check, f"rl_engine declares {desc.get('backend_id')} "
                      f"for {platform}; not exercised by the probe", platform,
                      provider="rl_engine", descriptor=dict(desc))
    return _entry(name, "unavailable", check, f"rl_engine declares {desc.get('backend_id')} "
                  f"only for {devices}, not {platform}", platform, "platform_unsupported",
                  provider="rl_engine", descriptor=dict(desc))


def r_provider_for_command(command: str) -> RProvider:
    """``workload`` when the runner runs the built-in reference workload, else ``rl_engine``."""
    return "workload" if "pytest_rlkernel_matrix.workload" in command else "rl_engine"


def capability_report(
    preflight: Mapping[str, Any],
    profile_backend: str,
    *,
    r_provider: RProvider = "workload",
) -> dict[str, Any]:
    """Capability report from a preflight record (or a bare probe output).

    ``profile_backend`` is the hardware profile's backend (cpu|cuda|rocm); ``r_provider`` says
    whose R kernels the runner uses (see ``r_provider_for_command``).
    """
    probe, unusable = _probe_of(preflight)
    torch_info = _map(probe.get("torch"))
    raw = _map(probe.get("capabilities_raw"))
    profile_backend = str(getattr(profile_backend, "value", profile_backend) or "cpu").lower()
    platform = _platform(torch_info, profile_backend)
    gpu = bool(raw.get("gpu"))
    count = int(raw.get("device_count") or 0)
    caps: dict[str, dict[str, Any]] = {
        "transformer_engine": _transformer_engine(raw, platform),
        "custom_all_reduce": _custom_all_reduce(raw, platform, gpu, count),
        "ipc": _ipc(raw, platform, gpu),
        "peer_access": _peer(raw, platform, gpu, count),
        "graph": _gpu_run(_NAMES["graph"][platform], _map(raw.get("graph")) or None,
                          "capture x * 2 + 1 in torch.cuda.CUDAGraph, refill x, replay",
                          platform, gpu, "captured and replayed a tiny graph with the right "
                          "result (whether vLLM/Megatron enable it is version dependent)",
                          "platform_unsupported"),
        "collectives": _collectives(raw, platform, gpu),
    }
    for key, entry in _sdpa(raw, platform, gpu).items():
        caps[f"attention.sdpa_{key}"] = entry
    caps["attention.flash_attn"] = _import_entry(
        "flash-attn", _map(raw.get("flash_attn")), "import flash_attn; read __version__",
        platform)
    caps["gemm"] = _gemm(raw, platform, gpu)
    caps["rl_engine.extension"] = _extension(probe, preflight, platform)
    for module in R_MODULES:
        caps[f"r_backend.{module}"] = (
            _r_workload(raw, module, platform, gpu, profile_backend)
            if r_provider == "workload"
            else _r_rl_engine(probe, raw, module, platform)
        )
    if unusable:  # nothing was really checked: keep the names, say why
        for entry in caps.values():
            entry.update(status="untested", check=f"not run: {unusable}", reason=unusable)
            entry.pop("unsupported_class", None)
            entry.pop("details", None)
    summary = {s: sum(1 for e in caps.values() if e["status"] == s) for s in STATUSES}
    notes: list[str] = []
    build = torch_info.get("build")
    if build and profile_backend != "cpu" and build != profile_backend:
        notes.append(f"profile backend is {profile_backend} but torch is a {build} build")
    return {
        "schema_version": SCHEMA_VERSION,
        "platform": platform,
        "profile_backend": profile_backend,
        "r_provider": r_provider,
        "gpu_count": count,
        "torch": torch_info.get("version"),
        "probe_seconds": raw.get("seconds"),
        "summary": summary,
        "notes": notes,
        "capabilities": caps,
    }


def requested_r_blockers(
    report: Mapping[str, Any], modules_needing_r: Iterable[str]
) -> list[tuple[str, str]]:
    """``(unsupported_class, reason)`` per requested module whose R backend is unavailable."""
    caps = _map(report.get("capabilities", report))
    found: list[tuple[str, str]] = []
    for module in dict.fromkeys(modules_needing_r):
        entry = _map(caps.get(f"r_backend.{module}"))
        if entry.get("status") == "unavailable":
            cls = str(entry.get("unsupported_class") or "platform_unsupported")
            found.append((cls, f"{module} R backend ({entry.get('name')}): "
                               f"{entry.get('reason')}"))
    return found


def runner_capabilities(preflight: Mapping[str, Any], profile_backend: str,
                        command: str | Sequence[str], r_provider: str = "auto") -> dict[str, Any]:
    """The capability report for a matrix runner (`[runner] command` and `r_provider`).

    `external`: the command brings R kernels preflight cannot check, so they are `untested`
    (strict mode then relies on the run's own evidence instead of failing before launch).
    """
    text = command if isinstance(command, str) else " ".join(command)
    provider = r_provider_for_command(text) if r_provider == "auto" else r_provider
    report = capability_report(preflight, profile_backend,
                               r_provider="rl_engine" if provider == "external" else provider)
    if provider == "external":
        for key, entry in report["capabilities"].items():
            if key.startswith("r_backend."):
                entry.update(status="untested", reason="[runner] r_provider = external: the "
                             "command's own R kernels; preflight cannot check them")
                entry.pop("unsupported_class", None)
        report["r_provider"] = "external"
        report["summary"] = {st: sum(1 for e in report["capabilities"].values()
                                     if e["status"] == st) for st in STATUSES}
    return report
