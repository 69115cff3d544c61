"""Read what RL-Kernel's consistency debugger writes (`rl_engine/alignment/debug/`, RL-Align/
RL-Kernel at 82fd031 and 4d39c20), as its own readers read it, failing closed:

- a **capture bundle** (`evidence.py`: `Capture.prepare` / `Capture.record`): a folder with
  `capture-manifest.json` (`schema_version` ``rlkernel.capture.v1``, `scope`, `boundaries[]`: `id`,
  `module`, `stage`, optional `layer`, `positions` (distinct non-negative ints), `width` (>= 1, or
  `dynamic_width` with no width), `contracts` (required contract keys), `inputs` (earlier
  boundary ids)) and `captures/{training|rollout}-rank{r}-call{k}.pt`, one record per file:
  `schema_version`, `boundary`, `side`, `identity` (weights, tokens, positions, mask, sampling),
  `contracts`, `route`, `tensors.value` ([rows, features], native dtype) and `metadata`
  (`stage_positions.value`, `feature_offsets.value`, `feature_sizes.value`). A `.lock` without
  its `.pt` is a capture that never finished (upstream: "incomplete capture");
- **Qwen3 layer replay** files (`qwen3_runtime.save_layer`): `diagnostics/layers/{side}-pid{p}-
  rank{r}-layer{L}-call{c}.pt` (``rlkernel.layer_replay.v1``: `side`, `rank`, `layer`, `call`,
  `positions`, `sequence_length`, `frozen_tokens_sha256`, `sampling`, `tensors` {stage: [rows,
  features]}, `metadata` with `stage_positions`, `feature_offsets`, `feature_sizes`, `tp_rank`,
  `tp_size`, `cp_rank`, `cp_size`, `contract`, `expected_layers`) and the runtime weight tiles
  `diagnostics/weights/{side}-pid{p}-rank{r}-layer{L}.json`;
- an upstream **report** `diagnostic-report.json` (``rlkernel.diagnostic_report.v2`` from
  `analyze_bundle`; ``v1`` from the Qwen3 replay's `analyze_replay`).

Every `.pt` goes through `judge.read.ptread` (numpy arrays; torch only where that reader declines),
every file through `store.safeio` (regular, inside the cell, capped). Nothing here judges: the
comparison is `judge.localise.debugger`. A reader never raises for a bad file; it says why in
`problems`, naming the file and the key.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pytest_rlkernel_matrix.judge.read import ptread
from pytest_rlkernel_matrix.store.safeio import (
    MAX_JSON_BYTES,
    MAX_PT_BYTES,
    Refused,
    listing,
    read_bytes,
)

CAPTURE_SCHEMA = "rlkernel.capture.v1"
LAYER_SCHEMA = "rlkernel.layer_replay.v1"
REPORT_SCHEMAS = ("rlkernel.diagnostic_report.v2", "rlkernel.diagnostic_report.v1")
IDENTITIES = ("weights", "tokens", "positions", "mask", "sampling")
SIDES = ("training", "rollout")
MANIFEST = "capture-manifest.json"
REPORT = "diagnostic-report.json"
_CAPTURE = re.compile(r"^(training|rollout)-rank(\d+)-call(\d+)\.pt$")
_LAYER = re.compile(r"^(training|rollout)(?:-pid(\d+))?-rank(\d+)-layer(\d+)-call(\d+)\.pt$")
MAX_CAPTURE_FILES = 100_000
BUNDLE_DIRS = ("debug", "debugger", "captures")


@dataclass
class Piece:
    """One record's tensor of one stage: rows at logical positions, features from `offset`."""

    value: np.ndarray  # [rows, features]
    positions: list[int]
    offset: int
    width: int | None  # the logical feature width the record declares (feature_sizes)
    dtype: str


@dataclass
class CaptureRecord:
    file: str
    side: str
    rank: int
    call: int
    boundary: str
    identity: dict[str, Any]
    contracts: dict[str, Any]
    route: str
    piece: Piece


@dataclass
class Bundle:
    """One capture bundle as read: its manifest, records, upstream report and problems."""

    path: str  # relative to the cell directory
    manifest: dict[str, Any] = field(default_factory=dict)
    boundaries: list[dict[str, Any]] = field(default_factory=list)
    records: list[CaptureRecord] = field(default_factory=list)
    report: dict[str, Any] | None = None
    problems: list[str] = field(default_factory=list)


@dataclass
class LayerRecord:
    file: str
    side: str
    rank: int
    layer: int
    call: int
    positions: list[int]
    sequence_length: int | None
    tokens_sha256: str | None
    sampling: str
    pieces: dict[str, Piece]
    metadata: dict[str, Any]
    weights_file: str


@dataclass
class Replay:
    """Qwen3 layer-replay files of one diagnostics directory."""

    path: str
    records: list[LayerRecord] = field(default_factory=list)
    weights: dict[str, dict[str, str] | None] = field(default_factory=dict)  # file -> tiles
    report: dict[str, Any] | None = None
    problems: list[str] = field(default_factory=list)
    heads: list[tuple[str, str, dict[str, Piece]]] = field(default_factory=list)  # file, side,
    head_weights: dict[str, dict[str, dict[str, Any]]] = field(  # side -> stem -> tiles
        default_factory=lambda: {s: {} for s in SIDES})
    layer0_weights: dict[str, set[str]] = field(default_factory=lambda: {s: set() for s in SIDES})
    identities: dict[str, list[dict[str, Any]]] = field(
        default_factory=lambda: {s: [] for s in SIDES})
    errors: list[str] = field(default_factory=list)  # failed captures (`errors/*.pt`)
    report_path: str | None = None  # where upstream's report was found
    arm_summary: dict[str, Any] | None = None  # single-arm-summary.json of the run directory


def _rel(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:
        return path.name


MAX_DEPTH = 4  # folders between the cell and a `diagnostics/` or a bundle (upstream: any)


def _depths(tail: str, deepest: int = MAX_DEPTH) -> list[str]:
    return ["/".join(["*"] * d + [tail]) for d in range(deepest + 1)]


def find(root: Path, problems: list[str]) -> tuple[list[Path], list[Path]]:
    """(capture bundle folders, layer-replay diagnostics folders) in a cell directory, where
    `rlk debug` finds them: a folder holding `capture-manifest.json`, and `diagnostics/layers`
    at any depth (upstream's `rglob`; its own tests nest it under `arms/r-r/`), here up to
    `MAX_DEPTH` folders down: one deeper is a problem (fail closed), never silently skipped. A
    `captures/` folder of capture files without its manifest is a problem too."""
    bundles: list[Path] = []
    replays: list[Path] = []
    for pattern in _depths(MANIFEST):
        bundles.extend(p.parent for p in listing(root, pattern, root, problems))
    for pattern in _depths("diagnostics/layers"):
        replays.extend(p.parent for p in listing(root, pattern, root, problems) if p.is_dir())
    for what in (MANIFEST, "diagnostics/layers"):
        deeper = listing(root, "/".join(["*"] * (MAX_DEPTH + 1) + [what]), root, problems)
        if deeper:
            problems.append(f"debugger: {_rel(deeper[0], root)} is more than {MAX_DEPTH} folders "
                            "below the cell: not read (the plugin's bound; rlk debug would read "
                            "it)")
    for pattern in _depths("captures"):
        for folder in listing(root, pattern, root, problems):
            if folder.is_dir() and not (folder.parent / MANIFEST).exists() and any(
                    _CAPTURE.match(p.name) for p in listing(folder, "*.pt", root, problems)):
                problems.append(f"debugger: {_rel(folder, root)} holds capture files but "
                                f"{_rel(folder.parent, root) or '.'} has no {MANIFEST}: a "
                                "bundle without its manifest cannot be judged")
    return sorted(set(bundles)), sorted(set(replays))


def _json(path: Path, root: Path, problems: list[str]) -> Any:
    """A JSON file's value, or `UNREAD` with the reason in `problems`."""
    try:
        return json.loads(read_bytes(path, root, MAX_JSON_BYTES).decode("utf-8"))
    except Refused as exc:
        problems.append(str(exc))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        problems.append(f"{_rel(path, root)}: not JSON: {type(exc).__name__}: {str(exc)[:120]}")
    return UNREAD


UNREAD = object()


class Widened(np.ndarray):
    """A half-precision tensor widened to float32 (exact, one to one) that remembers the dtype
    it was stored in (`source_dtype`): upstream compares dtypes, it never widens (issue 50)."""

    source_dtype: str = ""

    def __array_finalize__(self, obj: Any) -> None:
        self.source_dtype = getattr(obj, "source_dtype", "")


def source_dtype(value: np.ndarray) -> str:
    """The dtype a tensor was stored in: `bfloat16` / `float16` for a widened one."""
    return getattr(value, "source_dtype", "") or str(value.dtype)


def _arrays(value: Any) -> Any:
    """torch tensors as numpy arrays, recursively; bfloat16/float16 widened to float32 (exact
    and one to one), as `Widened` arrays that keep their stored dtype."""
    if type(value).__module__.startswith("torch") and hasattr(value, "numpy"):
        import torch

        t = value.detach().cpu()
        if t.dtype in (torch.bfloat16, torch.float16):
            out = t.to(torch.float32).numpy().view(Widened)
            out.source_dtype = str(t.dtype).replace("torch.", "")
            return out
        return t.numpy()
    if isinstance(value, dict):
        return {k: _arrays(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_arrays(v) for v in value]
    return value


def load_pt(path: Path, root: Path, problems: list[str]) -> dict[str, Any] | None:
    """A `.pt` file's dict with numpy arrays, or None with the reason in `problems`."""
    name = _rel(path, root)
    try:
        raw = read_bytes(path, root, MAX_PT_BYTES)
    except Refused as exc:
        problems.append(str(exc))
        return None
    # ptread's fast path widens bfloat16 without a trace of it: such files go torch's way,
    # where `_arrays` keeps the stored dtype (float16 goes that way already)
    data = None if b"BFloat16Storage" in raw else ptread.load_arrays(raw, name)
    if data is None:
        data = ptread.pt_dict(raw, name, problems)
        data = None if data is None else _arrays(data)
    if data is not None and not isinstance(data, dict):
        problems.append(f"{name}: not a dict")
        return None
    return data


def boundary_problems(boundaries: Any) -> list[str]:
    """Upstream's `_specifications` rules for a manifest's `boundaries`, as reasons."""
    if not isinstance(boundaries, list) or not boundaries:
        return ["boundaries: declare at least one semantic boundary (a non-empty list)"]
    out: list[str] = []
    seen: set[str] = set()
    for i, spec in enumerate(boundaries):
        if not isinstance(spec, dict):
            out.append(f"boundaries[{i}]: not an object")
            continue
        name = spec.get("id")
        if not isinstance(name, str) or not name or name in seen:
            out.append(f"boundaries[{i}].id: boundary IDs must be unique nonempty strings")
            continue
        if not spec.get("module") or not spec.get("stage"):
            out.append(f"{name}: module and stage are required")
        inputs = spec.get("inputs", [])
        if not isinstance(inputs, list) or any(p not in seen for p in inputs):
            out.append(f"{name}: inputs must precede output in semantic execution order")
        positions = spec.get("positions")
        dynamic = bool(spec.get("dynamic_width", False))
        width = spec.get("width")
        if (not isinstance(positions, list) or not positions
                or any(type(p) is not int or p < 0 for p in positions)
                or len(set(positions)) != len(positions)
                or (not dynamic and (type(width) is not int or width < 1))
                or (dynamic and width not in (None, 0))):
            out.append(f"{name}: declare nonempty logical positions and feature width")
        if not isinstance(spec.get("contracts", []), list):
            out.append(f"{name}: contracts must list required observed contract keys")
        seen.add(name)
    return out


def _int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "iu":
        return int(value)
    return None


def _positions(value: Any) -> list[int] | None:
    if isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype.kind in "iu":
        return [int(x) for x in value.tolist()]
    if isinstance(value, list) and all(_int(x) is not None for x in value):
        return [int(x) for x in value]
    return None


def _piece(tensors: Any, metadata: Any, stage: str, where: str,
           problems: list[str]) -> Piece | None:
    value = tensors.get(stage) if isinstance(tensors, dict) else None
    if not isinstance(value, np.ndarray):
        problems.append(f"{where}: tensors.{stage} is not a tensor")
        return None
    if value.ndim != 2 or value.dtype.kind not in "fiub":
        problems.append(f"{where}: tensors.{stage}: expected normalized [rows, features] tensor "
                        f"(got {value.ndim}-d {value.dtype})")
        return None
    meta = metadata if isinstance(metadata, dict) else {}
    stage_pos = meta.get("stage_positions")
    positions = _positions(stage_pos.get(stage)) if isinstance(stage_pos, dict) else None
    if positions is None:
        problems.append(f"{where}: metadata.stage_positions.{stage} is not a 1-d integer list")
        return None
    if len(positions) != value.shape[0]:
        problems.append(f"{where}: {stage}: token map length differs from tensor "
                        f"({len(positions)} positions, {value.shape[0]} rows)")
        return None
    offsets = meta.get("feature_offsets", {})
    offset = _int(offsets.get(stage, 0)) if isinstance(offsets, dict) else None
    if offset is None or offset < 0:
        problems.append(f"{where}: metadata.feature_offsets.{stage} is not a non-negative int")
        return None
    sizes = meta.get("feature_sizes", {})
    width = _int(sizes.get(stage)) if isinstance(sizes, dict) else None
    return Piece(np.ascontiguousarray(value), positions, offset, width, source_dtype(value))


def read_bundle(directory: Path, root: Path) -> Bundle:
    """One capture bundle; problems name the file and the key. Never raises for a bad file."""
    b = Bundle(path=_rel(directory, root) if directory != root else ".")
    manifest = _json(directory / MANIFEST, root, b.problems)
    if manifest is UNREAD:
        return b
    where = f"{b.path}/{MANIFEST}"
    if not isinstance(manifest, dict):
        b.problems.append(f"{where}: not a JSON object")
        return b
    if manifest.get("schema_version") != CAPTURE_SCHEMA:
        b.problems.append(f"{where}: schema_version {manifest.get('schema_version')!r} is not "
                          f"{CAPTURE_SCHEMA!r} (a foreign or newer bundle: not read)")
        return b
    b.manifest = manifest
    bad = boundary_problems(manifest.get("boundaries"))
    if bad:
        b.problems.extend(f"{where}: {p}" for p in bad)
        return b
    b.boundaries = manifest["boundaries"]
    ids = {s["id"] for s in b.boundaries}
    folder = directory / "captures"
    files = listing(folder, "*.pt", root, b.problems)
    if len(files) > MAX_CAPTURE_FILES:
        b.problems.append(f"{b.path}/captures: {len(files)} files, more than "
                          f"{MAX_CAPTURE_FILES}: not read")
        return b
    for lock in listing(folder, "*.lock", root, b.problems):
        if not lock.with_suffix(".pt").is_file():
            b.problems.append(f"{b.path}/captures: incomplete capture: {lock.stem} (a lock "
                              "without its .pt)")
    if not files:
        b.problems.append(f"{b.path}/captures: no capture records")
    for path in files:
        name = f"{b.path}/captures/{path.name}"
        m = _CAPTURE.match(path.name)
        if m is None:
            b.problems.append(f"{name}: not a capture record's name "
                              "({training|rollout}-rank{r}-call{k}.pt)")
            continue
        data = load_pt(path, root, b.problems)
        if data is None:
            continue
        if data.get("schema_version") != CAPTURE_SCHEMA:
            b.problems.append(f"{name}: schema_version {data.get('schema_version')!r} is not "
                              f"{CAPTURE_SCHEMA!r}")
            continue
        if data.get("boundary") not in ids:
            b.problems.append(f"{name}: boundary {data.get('boundary')!r} is not in the manifest")
            continue
        if data.get("side") != m.group(1):
            b.problems.append(f"{name}: side {data.get('side')!r} differs from its file name")
            continue
        identity = data.get("identity")
        if not isinstance(identity, dict):
            b.problems.append(f"{name}: identity is not a dict")
            continue
        missing = [k for k in IDENTITIES if identity.get(k) is None]
        if missing:
            b.problems.append(f"{name}: incomplete runtime identity (no {', '.join(missing)})")
        contracts = data.get("contracts", {})
        if not isinstance(contracts, dict):
            b.problems.append(f"{name}: contracts is not a dict")
            continue
        piece = _piece(data.get("tensors"), data.get("metadata"), "value", name, b.problems)
        if piece is None:
            continue
        b.records.append(CaptureRecord(name, m.group(1), int(m.group(2)), int(m.group(3)),
                                       str(data["boundary"]), identity, contracts,
                                       str(data.get("route", "unknown")), piece))
    b.report = read_report(directory, root, b.problems)
    return b


SESSION_SCHEMA = "debug_matrix_report.v2"  # RL-Kernel's own matrix-report.json (`rlk debug`)


def replay_report_path(directory: Path, root: Path, problems: list[str]) -> Path | None:
    """Where `rlk debug` left the report of the replay in `directory` (a `diagnostics/`
    folder): `diagnostics/diagnostic-report.json` (`rlk debug <diagnostics>`), else the nearest
    `diagnostic-report.json` of a folder above it inside the cell that is not a capture
    bundle (`rlk debug <run dir>` writes `<run dir>/diagnostic-report.json`), else a live
    session's `<session root>/<group>.report.json` where the session root holds RL-Kernel's
    `matrix-report.json` naming this run directory as the group's `run_dir`."""
    folder = directory
    while True:
        if (folder / REPORT).is_file() and not (folder / MANIFEST).exists():
            return folder / REPORT
        if folder == root or root not in folder.parents:
            break
        folder = folder.parent
    folder = directory.parent
    while True:
        path = _session_report(folder, directory.parent, root, problems)
        if path is not None:
            return path
        if folder == root or root not in folder.parents:
            return None
        folder = folder.parent


def _session_report(session: Path, run_dir: Path, root: Path,
                    problems: list[str]) -> Path | None:
    matrix = session / "matrix-report.json"
    if not matrix.is_file():
        return None
    data = _json(matrix, root, problems)
    if not isinstance(data, dict) or not isinstance(data.get("groups"), list):
        return None  # (not RL-Kernel's session report: read by nobody here)
    for group in data["groups"]:
        if not isinstance(group, dict) or not isinstance(group.get("group"), str):
            continue
        named = Path(str(group.get("run_dir") or ""))
        rel = _rel(run_dir, session)
        if named == run_dir or str(named).endswith("/" + rel) or str(named) == rel:
            path = session / f"{group['group']}.report.json"
            return path if path.is_file() else None
    return None


def read_report(directory: Path, root: Path, problems: list[str],
                path: Path | None = None) -> dict[str, Any] | None:
    """An upstream `diagnostic-report.json` in `directory` (or at `path`), if there is one."""
    path = path or directory / REPORT
    if not (path.exists() or path.is_symlink()):
        return None
    data = _json(path, root, problems)
    where = _rel(path, root)
    if data is UNREAD:
        return None
    if not isinstance(data, dict):
        problems.append(f"{where}: not a JSON object")
        return None
    if data.get("schema_version") not in REPORT_SCHEMAS:
        problems.append(f"{where}: schema_version {data.get('schema_version')!r} is not one of "
                        f"{', '.join(REPORT_SCHEMAS)}")
        return None
    if data.get("status") not in ("equal", "diverged", "not_comparable"):
        problems.append(f"{where}: status {data.get('status')!r} is not equal / diverged / "
                        "not_comparable")
        return None
    first = data.get("first_divergence")
    if first is not None and not isinstance(first, dict):
        problems.append(f"{where}: first_divergence is not an object")
        return None
    return data


HEAD_STAGES = ("head_input", "logits")


def _read_heads(directory: Path, root: Path, r: Replay) -> None:
    """`heads/*.pt` (the LM head's input and logits per side, qwen3_report.analyze_head) and
    the weight tiles `weights/{side}-*-head.json` beside the layer-0 ones."""
    files = listing(directory / "heads", "*.pt", root, r.problems)
    for path in files[:MAX_CAPTURE_FILES]:
        name = f"{r.path}/heads/{path.name}"
        data = load_pt(path, root, r.problems)
        if data is None:
            continue
        side, call = data.get("side"), _int(data.get("call"))
        if side not in SIDES or call is None:
            r.problems.append(f"{name}: side {side!r} / call {data.get('call')!r} malformed")
            continue
        if side == "training" and call != 0:
            continue  # the pre-update score only, as for the layers
        pieces: dict[str, Piece] = {}
        tensors, meta = data.get("tensors"), data.get("metadata")
        for stage in HEAD_STAGES:
            if isinstance(tensors, dict) and stage in tensors:
                piece = _piece(tensors, meta, stage, name, r.problems)
                if piece is not None:
                    pieces[stage] = piece
        r.heads.append((name, str(side), pieces))
    for side in SIDES:
        for path in listing(directory / "weights", f"{side}-*-head.json", root, r.problems):
            tiles = _json(path, root, r.problems)
            r.head_weights[side][path.stem.removesuffix("-head")] = (
                tiles if isinstance(tiles, dict) else {})
        r.layer0_weights[side] = {p.stem.removesuffix("-layer0") for p in listing(
            directory / "weights", f"{side}-*-layer0.json", root, r.problems)}


def _read_identities(directory: Path, root: Path, r: Replay) -> None:
    """`identity/*.json`: each side's runtime token / mask / sampling identity."""
    for path in listing(directory / "identity", "*.json", root, r.problems):
        value = _json(path, root, r.problems)
        if not isinstance(value, dict) or value.get("side") not in SIDES:
            r.problems.append(f"{r.path}/identity/{path.name}: not an identity of a side")
            continue
        value = dict(value)
        r.identities[str(value.pop("side"))].append(value)


def read_replay(directory: Path, root: Path) -> Replay:
    """The layer-replay files of one diagnostics folder (`layers/`, `weights/`)."""
    r = Replay(path=_rel(directory, root))
    files = listing(directory / "layers", "*.pt", root, r.problems)
    if not files:
        r.problems.append(f"{r.path}/layers: no layer replay files")
    if len(files) > MAX_CAPTURE_FILES:
        r.problems.append(f"{r.path}/layers: {len(files)} files: not read")
        return r
    for path in listing(directory / "errors", "*.pt", root, r.problems):
        r.errors.append(f"{r.path}/errors/{path.name}")
        r.problems.append(f"{r.path}/errors/{path.name}: a capture failed on the run (upstream "
                          "records it there; its analyze_replay says not_comparable)")
    _read_heads(directory, root, r)
    _read_identities(directory, root, r)
    for path in files:
        name = f"{r.path}/layers/{path.name}"
        m = _LAYER.match(path.name)
        if m is None:
            r.problems.append(f"{name}: invalid diagnostic layer filename")
            continue
        data = load_pt(path, root, r.problems)
        if data is None:
            continue
        if data.get("schema_version") != LAYER_SCHEMA:
            r.problems.append(f"{name}: schema_version {data.get('schema_version')!r} is not "
                              f"{LAYER_SCHEMA!r}")
            continue
        side, call = m.group(1), _int(data.get("call"))
        if data.get("side") != side or _int(data.get("layer")) != int(m.group(4)) or (
                call != int(m.group(5))):
            r.problems.append(f"{name}: side/layer/call differ from its file name")
            continue
        positions = _positions(data.get("positions"))
        tensors, meta = data.get("tensors"), data.get("metadata")
        if positions is None or not isinstance(tensors, dict) or not isinstance(meta, dict):
            r.problems.append(f"{name}: positions, tensors or metadata missing or malformed")
            continue
        pieces: dict[str, Piece] = {}
        for stage in tensors:
            piece = _piece(tensors, meta, str(stage), name, r.problems)
            if piece is not None:
                pieces[str(stage)] = piece
        stem = path.stem.rsplit("-call", 1)[0]
        weights = f"{r.path}/weights/{stem}.json"
        if weights not in r.weights:
            wpath = directory / "weights" / f"{stem}.json"
            tiles = _json(wpath, root, r.problems) if wpath.exists() else None
            r.weights[weights] = tiles if isinstance(tiles, dict) else None
        r.records.append(LayerRecord(
            name, side, int(m.group(3)), int(m.group(4)), int(call), positions,
            _int(data.get("sequence_length")),
            str(data.get("frozen_tokens_sha256")) if data.get("frozen_tokens_sha256") else None,
            json.dumps(data.get("sampling"), sort_keys=True, default=str), pieces, meta,
            weights))
    where = replay_report_path(directory, root, r.problems)
    r.report = None if where is None else read_report(directory, root, r.problems, where)
    r.report_path = None if where is None else _rel(where, root)
    r.arm_summary = _arm_summary(directory.parent, root, r.problems)
    return r


def _arm_summary(run_dir: Path, root: Path, problems: list[str]) -> dict[str, Any] | None:
    """`single-arm-summary.json` of the replay's run directory, if there is one."""
    path = run_dir / "single-arm-summary.json"
    if not path.is_file():
        return None
    data = _json(path, root, problems)
    if not isinstance(data, dict):
        problems.append(f"{_rel(path, root)}: not a JSON object")
        return None
    return data
