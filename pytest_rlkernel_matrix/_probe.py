"""Environment probe run in the *target* Python: prints one JSON object on its last stdout line.

Run as ``python path/to/_probe.py`` or ``python -m pytest_rlkernel_matrix._probe``. It imports
only what it must (torch, ``rl_engine`` and its extension); other versions come from
``importlib.metadata`` or source files. Missing packages are recorded, never raised. The script
imports nothing from this package so it works in any interpreter that can read the file.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import importlib
import importlib.metadata as metadata
import importlib.util
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

PROBE_VERSION = 1

# key -> (candidate distribution names, importable module name)
PACKAGES: dict[str, tuple[tuple[str, ...], str]] = {
    "torch": (("torch",), "torch"),
    "vllm": (("vllm",), "vllm"),
    "vllm-router": (("vllm-router", "vllm_router"), "vllm_router"),
    "megatron-core": (("megatron-core", "megatron_core"), "megatron.core"),
    "transformer-engine": (
        ("transformer-engine", "transformer_engine", "transformer-engine-torch"),
        "transformer_engine",
    ),
    "flash-attn": (("flash-attn", "flash_attn"), "flash_attn"),
    "triton": (("triton", "pytorch-triton-rocm", "pytorch-triton"), "triton"),
    "numpy": (("numpy",), "numpy"),
    "transformers": (("transformers",), "transformers"),
    "ray": (("ray",), "ray"),
    "vime": (("vime",), "vime"),
}
_OFFLOAD_ARCH = re.compile(rb"amdgcn-amd-amdhsa-+(gfx[0-9a-f]+)")


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:500]


def _find_spec(name: str) -> tuple[Any, str | None]:
    """Find a module spec without importing it (parents of dotted names may be imported)."""
    try:
        return importlib.util.find_spec(name), None
    except ModuleNotFoundError:
        return None, None
    except Exception as exc:
        return None, _err(exc)


def _dist_version(names: tuple[str, ...]) -> tuple[str | None, str | None]:
    for name in names:
        try:
            return name, metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        except Exception:
            continue
    return None, None


def _dists_for_module(top: str) -> list[str]:
    try:
        return sorted(set(metadata.packages_distributions().get(top, [])))
    except Exception:
        return []


def _megatron_source_version() -> str | None:
    """Read ``megatron/core/package_info.py`` without importing megatron (source checkouts)."""
    spec, _ = _find_spec("megatron")
    if spec is None or not spec.submodule_search_locations:
        return None
    for base in spec.submodule_search_locations:
        info = Path(base) / "core" / "package_info.py"
        if not info.is_file():
            continue
        values: dict[str, object] = {}
        with contextlib.suppress(Exception):
            for node in ast.parse(info.read_text(encoding="utf-8")).body:
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
                    for target in node.targets:
                        if isinstance(target, ast.Name):
                            values[target.id] = node.value.value
        if "MAJOR" in values:
            version = f"{values.get('MAJOR')}.{values.get('MINOR', 0)}.{values.get('PATCH', 0)}"
            return version + str(values.get("PRE_RELEASE") or "")
    return None


def probe_packages() -> dict[str, dict[str, Any]]:
    """Version and location of each known package, without importing it."""
    out: dict[str, dict[str, Any]] = {}
    for key, (dists, module) in PACKAGES.items():
        dist, version = _dist_version(dists)
        if dist is None:
            dist, version = _dist_version(tuple(_dists_for_module(module.split(".")[0])))
        spec, error = _find_spec(module)
        entry: dict[str, Any] = {
            "dist": dist,
            "version": version,
            "module": module,
            "module_found": spec is not None,
            "origin": getattr(spec, "origin", None) if spec is not None else None,
        }
        if key == "megatron-core" and version is None and spec is not None:
            entry["version"] = _megatron_source_version()
            entry["version_source"] = "megatron/core/package_info.py"
        if error:
            entry["error"] = error
        out[key] = entry
    return out


def probe_torch() -> dict[str, Any]:
    """Torch build and device facts; imports torch only when it is installed."""
    spec, error = _find_spec("torch")
    if spec is None:
        return {"installed": False, "error": error}
    try:
        torch = importlib.import_module("torch")
    except Exception as exc:
        return {"installed": True, "importable": False, "error": _err(exc)}
    version = getattr(torch, "version", None)
    info: dict[str, Any] = {
        "installed": True,
        "importable": True,
        "version": str(torch.__version__),
        "cuda": getattr(version, "cuda", None),
        "hip": getattr(version, "hip", None),
        "git_version": getattr(version, "git_version", None),
        "file": getattr(torch, "__file__", None),
    }
    info["build"] = "rocm" if info["hip"] else ("cuda" if info["cuda"] else "cpu")
    try:
        info["cuda_available"] = bool(torch.cuda.is_available())
        info["device_count"] = int(torch.cuda.device_count())
    except Exception as exc:
        info.update(cuda_available=False, device_count=0, device_error=_err(exc))
    with contextlib.suppress(Exception):
        info["arch_list"] = list(torch.cuda.get_arch_list())
    devices: list[dict[str, Any]] = []
    for index in range(info["device_count"]):
        dev: dict[str, Any] = {"index": index}
        try:
            props = torch.cuda.get_device_properties(index)
            dev["name"] = str(props.name)
            dev["total_memory"] = int(props.total_memory)
            dev["capability"] = [int(props.major), int(props.minor)]
            dev["multi_processor_count"] = int(props.multi_processor_count)
            arch = getattr(props, "gcnArchName", None)
            if arch:
                dev["gcnArchName"] = str(arch)
        except Exception as exc:
            dev["error"] = _err(exc)
        devices.append(dev)
    info["devices"] = devices
    try:
        nccl = torch.cuda.nccl.version()
        info["nccl_version"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    except Exception as exc:
        info["nccl_version"] = None
        info["nccl_error"] = _err(exc)
    with contextlib.suppress(Exception):
        info["cudnn_version"] = torch.backends.cudnn.version()
    return info


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _offload_archs(path: Path) -> list[str]:
    """gfx targets embedded in a HIP fat binary (empty for CUDA/CPU builds)."""
    try:
        return sorted({m.decode() for m in _OFFLOAD_ARCH.findall(path.read_bytes())})
    except OSError:
        return []


def probe_rl_engine() -> dict[str, Any]:
    """Whether ``rl_engine`` and its ``_C`` extension load, plus the extension's sha256."""
    spec, error = _find_spec("rl_engine")
    info: dict[str, Any] = {"found": spec is not None, "importable": False}
    if spec is None:
        if error:
            info["error"] = error
        return info
    dists = _dists_for_module("rl_engine")
    info["dist"] = dists[0] if dists else None
    info["version"] = _dist_version(tuple(dists))[1] if dists else None
    try:
        mod = importlib.import_module("rl_engine")
        info["importable"] = True
        info["file"] = getattr(mod, "__file__", None)
        info["version"] = str(getattr(mod, "__version__", None) or info["version"] or "") or None
    except Exception as exc:
        info["file"] = spec.origin
        info["error"] = _err(exc)
    ext_loaded = False
    ext_file: str | None = None
    try:
        ext = importlib.import_module("rl_engine._C")
        ext_loaded = True
        ext_file = getattr(ext, "__file__", None)
    except Exception as exc:
        info["ext_error"] = _err(exc)
        ext_spec, _ = _find_spec("rl_engine._C") if info["importable"] else (None, None)
        ext_file = getattr(ext_spec, "origin", None) if ext_spec is not None else None
    info["ext_loaded"] = ext_loaded
    info["ext_file"] = ext_file
    info["ext_sha256"] = None
    if ext_file and os.path.isfile(ext_file):
        with contextlib.suppress(OSError):
            info["ext_sha256"] = _sha256_file(Path(ext_file))
        info["ext_offload_archs"] = _offload_archs(Path(ext_file))
    return info


def probe() -> dict[str, Any]:
    """Collect everything; never raises."""
    result: dict[str, Any] = {
        "probe_version": PROBE_VERSION,
        "python": {
            "version": sys.version,
            "executable": sys.executable,
            "prefix": sys.prefix,
            "implementation": sys.implementation.name,
        },
        "packages": probe_packages(),
    }
    for key, func in (("torch", probe_torch), ("rl_engine", probe_rl_engine)):
        try:
            result[key] = func()
        except Exception as exc:
            result[key] = {"error": _err(exc)}
    return result


def main() -> int:
    """Print the probe as the last stdout line; chatter from imports goes to stderr."""
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if not p or Path(p).resolve() != here]
    with contextlib.redirect_stdout(sys.stderr):
        result = probe()
    sys.stdout.write("\n" + json.dumps(result, sort_keys=True, default=str) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
