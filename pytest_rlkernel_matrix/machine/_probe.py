"""Environment probe run in the *target* Python: prints one JSON object on its last stdout line.

Run as ``python path/to/_probe.py`` or ``python -m pytest_rlkernel_matrix.machine._probe``.
It imports only what it must (torch, ``rl_engine`` and its extension); other versions come from
``importlib.metadata`` or source files. Missing packages are recorded, never raised. The script
imports nothing from this package at load, so it works in any interpreter that can read the file;
only the capability check of the workload's R kernels imports the sibling ``workload.kernels``.
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
import pickle
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
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


# --------------------------------------------------------------------------- capabilities

# module -> (rl_engine semantic op, preferred RL-Kernel backend id)
RL_ENGINE_R_OPS: dict[str, tuple[str, str]] = {
    "attention": ("attention", "rlkernel.attention.deterministic.v1"),
    "ffn": ("ffn", "rlkernel.ffn.qwen3.deterministic.v1"),
    "logp": ("selected_logprob", "rlkernel.reference_logp"),
}
_IPC_CHILD = (
    "import pickle, sys, torch\n"
    "fn, args = pickle.loads(sys.stdin.buffer.read())\n"
    "t = fn(*args)\n"
    "t.add_(1)\n"
    "torch.cuda.synchronize()\n"
    "print(float(t.sum()))\n"
)


def _timed(func: Any, *args: Any) -> dict[str, Any]:
    """Run one check; its dict gets ``seconds``; an exception becomes ``{ok: False, error}``."""
    start = time.monotonic()
    try:
        out = dict(func(*args))
    except Exception as exc:
        out = {"ok": False, "error": _err(exc)}
    out["seconds"] = round(time.monotonic() - start, 4)
    return out


def _import_check(module: str, extra: str | None = None) -> dict[str, Any]:
    """Import ``module`` (and ``extra``, e.g. its torch bindings) only when it is installed."""
    spec, error = _find_spec(module)
    out: dict[str, Any] = {"module": module, "found": spec is not None, "importable": False}
    if spec is None:
        if error:
            out["error"] = error
        return out
    try:
        mod = importlib.import_module(module)
        out["version"] = str(getattr(mod, "__version__", "") or "") or None
        if extra:
            importlib.import_module(extra)
        out["importable"] = True
    except Exception as exc:
        out["error"] = _err(exc)
    return out


def _custom_all_reduce(torch: Any, platform: str) -> dict[str, Any]:
    if platform != "cuda":
        return {"skipped": f"CUDA-only check, platform is {platform}"}
    comm = "vllm.distributed.device_communicators.custom_all_reduce"
    out = _import_check("vllm._custom_ops")
    if out["importable"]:
        ops = importlib.import_module("vllm._custom_ops")
        out["has_init_custom_ar"] = hasattr(ops, "init_custom_ar")
        spec, _ = _find_spec(comm)
        out["communicator_found"] = spec is not None
    return out


def _ipc_same_device(torch: Any) -> dict[str, Any]:
    """Share a CUDA/HIP tensor with a second process, which adds 1 to it in place."""
    from torch.multiprocessing.reductions import reduce_tensor

    shared = torch.zeros(4, device="cuda:0")
    torch.cuda.synchronize()
    payload = pickle.dumps(reduce_tensor(shared))
    proc = subprocess.run(
        [sys.executable, "-c", _IPC_CHILD], input=payload, capture_output=True, timeout=120
    )
    torch.cuda.synchronize()
    seen = shared.tolist()
    del payload
    torch.cuda.ipc_collect()  # release the sent block now, not at exit with a warning
    out: dict[str, Any] = {"ok": proc.returncode == 0 and seen == [1.0] * 4, "seen": seen}
    if proc.returncode != 0:
        out["error"] = proc.stderr.decode("utf-8", "replace")[-500:]
    return out


def _peer_access(torch: Any, count: int) -> dict[str, Any]:
    pairs = {}
    for a in range(min(count, 8)):
        for b in range(min(count, 8)):
            if a != b:
                pairs[f"{a}->{b}"] = bool(torch.cuda.can_device_access_peer(a, b))
    src = torch.arange(16.0, device="cuda:0")
    copied = src.to("cuda:1")
    torch.cuda.synchronize()
    ok = all(pairs.values()) and bool((copied.cpu() == src.cpu()).all())
    return {"ok": ok, "pairs": pairs}


def _graph(torch: Any) -> dict[str, Any]:
    """Capture ``y = x * 2 + 1`` in a CUDA/HIP graph, refill ``x`` and replay."""
    x = torch.ones(8, device="cuda:0")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = x * 2 + 1  # warm-up off the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x * 2 + 1
    x.fill_(3.0)
    graph.replay()
    torch.cuda.synchronize()
    return {"ok": bool((y == 7).all()), "result": float(y[0])}


def _nccl(torch: Any, gpu: bool) -> dict[str, Any]:
    import tempfile

    dist = importlib.import_module("torch.distributed")
    out: dict[str, Any] = {"available": bool(dist.is_available() and dist.is_nccl_available())}
    out["gloo_available"] = bool(dist.is_available() and dist.is_gloo_available())
    with contextlib.suppress(Exception):
        raw = torch.cuda.nccl.version()
        out["version"] = ".".join(map(str, raw)) if isinstance(raw, tuple) else str(raw)
    if not (gpu and out["available"]):
        return out
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1)
        try:
            t = torch.ones(4, device="cuda:0")
            dist.all_reduce(t)
            torch.cuda.synchronize()
            out["single_rank_all_reduce"] = bool((t == 1).all())
        finally:
            dist.destroy_process_group()
    out["ok"] = out["single_rank_all_reduce"]
    return out


def _sdpa(torch: Any, gpu: bool) -> dict[str, Any]:
    """Enabled flags plus a tiny forward forced onto each SDPA backend."""
    back = torch.backends.cuda
    out: dict[str, Any] = {"flags": {}, "runs": {}}
    for key, flag in (
        ("flash", "flash_sdp_enabled"),
        ("mem_efficient", "mem_efficient_sdp_enabled"),
        ("math", "math_sdp_enabled"),
        ("cudnn", "cudnn_sdp_enabled"),
    ):
        with contextlib.suppress(Exception):
            out["flags"][key] = bool(getattr(back, flag)())
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kinds = {"flash": "FLASH_ATTENTION", "mem_efficient": "EFFICIENT_ATTENTION", "math": "MATH"}
    if gpu:
        kinds["cudnn"] = "CUDNN_ATTENTION"
    device, dtype = ("cuda:0", torch.bfloat16) if gpu else ("cpu", torch.float32)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 64, generator=gen).to(device, dtype) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double().cpu(), k.double().cpu(), v.double().cpu(), is_causal=True
    )
    for key, name in kinds.items():
        if not gpu and key != "math":
            continue
        try:
            with sdpa_kernel(getattr(SDPBackend, name)):
                o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            err = float((o.double().cpu() - ref).abs().max())
            out["runs"][key] = {"ok": err < 5e-2, "max_abs_err": err}
        except Exception as exc:
            out["runs"][key] = {"ok": False, "error": _err(exc)}
    return out


def _gemm(torch: Any, gpu: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with contextlib.suppress(Exception):
        out["preferred_blas_library"] = str(torch.backends.cuda.preferred_blas_library())
    device, dtype = ("cuda:0", torch.bfloat16) if gpu else ("cpu", torch.float32)
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(32, 64, generator=gen), torch.randn(64, 16, generator=gen)
    c = torch.mm(a.to(device, dtype), b.to(device, dtype)).double().cpu()
    err = float((c - a.double() @ b.double()).abs().max())
    out.update(ok=err < 0.5, max_abs_err=err, device=device, dtype=str(dtype))
    return out


def _load_workload_kernels() -> Any:
    """This probe's own ``pytest_rlkernel_matrix.workload.kernels.side`` (same checkout)."""
    root = str(Path(__file__).resolve().parents[1])
    sys.path.insert(0, root)
    try:
        return importlib.import_module("pytest_rlkernel_matrix.workload.kernels.side")
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(root)


def _workload_r(torch: Any, gpu: bool) -> dict[str, Any]:
    """Run the reference workload's R attention/FFN/logp on a tiny input against float64."""
    kern = _load_workload_kernels()
    device = torch.device("cuda:0" if gpu else "cpu")
    tiling = kern.Tiling.for_device(device, key_span=4)
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> Any:
        return torch.randn(*shape, generator=gen) * 0.5

    def result(got: Any, ref: Any) -> dict[str, Any]:
        err = float((got.double().cpu() - ref).abs().max())
        return {"ok": err < 1e-3, "max_abs_err": err}

    def attention() -> dict[str, Any]:
        q, k, v = rand(1, 3, 4, 8), rand(1, 3, 2, 8), rand(1, 3, 2, 8)
        pos = torch.arange(3)[None]
        got = kern.r_core_attention(*(t.to(device) for t in (q, pos, k, v)), tiling)
        qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k, v))
        ref = torch.nn.functional.scaled_dot_product_attention(
            qd, kd.repeat_interleave(2, 1), vd.repeat_interleave(2, 1), is_causal=True
        ).transpose(1, 2).reshape(1, 3, 32)
        return result(got, ref)

    def ffn() -> dict[str, Any]:
        lw = SimpleNamespace(index=0, gate_proj=rand(12, 8), up_proj=rand(12, 8),
                             down_proj=rand(8, 12), post_norm=rand(8) + 1)
        lw_dev = SimpleNamespace(
            **{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in vars(lw).items()}
        )
        x = rand(1, 3, 8)
        op = kern.FfnKernel("ffn", "training", "rl_kernel", torch.float32, tiling, 1e-6)
        got = op(x.to(device), lw_dev)
        xd = x.double()
        h = xd * torch.rsqrt(xd.square().mean(-1, keepdim=True) + 1e-6) * lw.post_norm.double()
        gate, up = h @ lw.gate_proj.double().t(), h @ lw.up_proj.double().t()
        return result(got, (gate * torch.sigmoid(gate) * up) @ lw.down_proj.double().t())

    def logp() -> dict[str, Any]:
        h, norm_w, head = rand(3, 8), rand(8) + 1, rand(16, 8)
        targets = torch.tensor([1, 5, 9])
        op = kern.LogpKernel("logp", "training", "rl_kernel", torch.float32, tiling, 1e-6)
        got = op.selected(h.to(device), norm_w.to(device), head.to(device), targets.to(device), 1.0)
        hd = h.double()
        hn = hd * torch.rsqrt(hd.square().mean(-1, keepdim=True) + 1e-6) * norm_w.double()
        lp = torch.log_softmax(hn @ head.double().t(), -1)
        return result(got, lp.gather(-1, targets[:, None])[:, 0])

    out: dict[str, Any] = {
        "device": str(device),
        "backend_ids": dict(kern.R_BACKEND_IDS),
        "contract": kern.R_CONTRACT_VERSION,
    }
    for name, func in (("attention", attention), ("ffn", ffn), ("logp", logp)):
        out[name] = _timed(func)
    return out


def _rl_engine_registry() -> dict[str, Any]:
    """What ``rl_engine``'s semantic operator catalog declares for each module's R backend."""
    registry = importlib.import_module("rl_engine.runtime.registry")
    catalog = registry.kernel_registry.semantic
    out: dict[str, Any] = {"api": "rl_engine.runtime.registry.kernel_registry.semantic"}
    for module, (op, preferred) in RL_ENGINE_R_OPS.items():
        descriptors = list(catalog.backend_descriptors(op))
        ids = [str(d.backend_id) for d in descriptors]
        chosen = next((d for d in descriptors if d.backend_id == preferred), None)
        if chosen is None:
            chosen = next((d for d in descriptors if d.backend_id != "native"), None)
        entry: dict[str, Any] = {"semantic_op": op, "backend_ids": ids, "descriptor": None}
        if chosen is not None:
            entry["descriptor"] = {
                "backend_id": str(chosen.backend_id),
                "supported_devices": sorted(map(str, chosen.supported_devices)),
                "supported_dtypes": sorted(map(str, chosen.supported_dtypes)),
                "supported_targets": sorted(map(str, chosen.supported_targets)),
                "fallback_policy": str(getattr(chosen.fallback_policy, "value", "")),
                "fingerprint": str(chosen.version_or_build_fingerprint),
            }
        out[module] = entry
    return out


def probe_capabilities(
    torch_info: dict[str, Any], rl_info: dict[str, Any]
) -> dict[str, Any]:
    """Raw capability checks; GPU checks only when torch sees a GPU; failures are recorded."""
    start = time.monotonic()
    platform = str(torch_info.get("build") or "cpu")
    count = int(torch_info.get("device_count") or 0)
    gpu = bool(torch_info.get("cuda_available")) and count > 0
    raw: dict[str, Any] = {"platform": platform, "gpu": gpu, "device_count": count}
    raw["transformer_engine"] = _timed(
        _import_check, "transformer_engine", "transformer_engine.pytorch"
    )
    raw["flash_attn"] = _timed(_import_check, "flash_attn")
    if not torch_info.get("importable"):
        raw["torch_missing"] = torch_info.get("error") or "torch not importable"
    else:
        torch = importlib.import_module("torch")
        raw["custom_all_reduce"] = _timed(_custom_all_reduce, torch, platform)
        raw["ipc"] = {"reductions_importable": _find_spec("torch.multiprocessing.reductions")[0]
                      is not None}
        if gpu:
            raw["ipc"]["same_device"] = _timed(_ipc_same_device, torch)
            if count >= 2:
                raw["peer_access"] = _timed(_peer_access, torch, count)
            raw["graph"] = _timed(_graph, torch)
        raw["nccl"] = _timed(_nccl, torch, gpu)
        raw["sdpa"] = _timed(_sdpa, torch, gpu)
        raw["gemm"] = _timed(_gemm, torch, gpu)
        raw["workload_r"] = _timed(_workload_r, torch, gpu)
    if rl_info.get("importable"):
        raw["rl_engine_registry"] = _timed(_rl_engine_registry)
    raw["seconds"] = round(time.monotonic() - start, 4)
    return raw


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
    try:
        result["capabilities_raw"] = probe_capabilities(result["torch"], result["rl_engine"])
    except Exception as exc:
        result["capabilities_raw"] = {"error": _err(exc)}
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
