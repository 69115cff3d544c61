"""Probe judgement: where inside a drifting module the two sides first part.

Reads a probe directory (``docs/artifact-format.md``, "Probes": ``<side>.rank{r:05d}.pt`` +
``index.json``) with the same care as the other readers (capped reads inside the cell directory,
``judge.read.ptread.read_pt``: ``torch.load(weights_only=True)`` or its one restricted reader, every
field type-checked), then, per operator in forward order: bitwise equal or not, max |delta|,
relative error; the first divergent operator with its side(s) and layer; the error's growth
through the layers; and at the probed tokens the full-vocabulary figures (KL both ways, total
variation, top-1 agreement, top-k overlap, the sampled token's logprob on
both sides tied back to the measured run's sidecar).

Anything that cannot be compared (a side absent, an operator missing on one side, shapes that
differ, tokens seen on one side only) is a reason in the result, never a silent skip.
torch is imported only when a probe is read.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from pytest_rlkernel_matrix.judge.read.ptread import read_pt_dict
from pytest_rlkernel_matrix.store.atomic import new_dir
from pytest_rlkernel_matrix.store.safeio import Refused, listing, read_bytes

SIDES = ("training", "rollout")
PROBE_SCHEMA = "rlk.operator_probe.v1"
MAX_PROBE_BYTES = 1024 * 1024 * 1024
MAX_INDEX_BYTES = 4 * 1024 * 1024
MAX_TOKENS = 4096
MAX_OPERATORS = 100_000
TOP_K = 5
_FILE_RE = re.compile(r"^(training|rollout)\.rank(\d{5})\.pt$")
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def operator_module(name: str) -> str | None:
    """The matrix module an operator belongs to (attention, ffn, logp) or None (embedding)."""
    m = _LAYER_RE.match(name)
    if m:
        leaf = m.group(2)
        return "attention" if leaf == "input_layernorm" or leaf.startswith("self_attn.") else "ffn"
    return "logp" if name in ("model.norm", "lm_head", "log_softmax") else None


def operator_layer(name: str) -> int | None:
    m = _LAYER_RE.match(name)
    return int(m.group(1)) if m else None


# ---------------------------------------------------------------------------------------------
# Which tokens to probe: from the measured run's sidecars.


def probe_positions(run_dir: Path, budget: int, controls: int = 2) -> tuple[
        list[tuple[int, int]], list[dict[str, Any]], list[str]]:
    """``(sample, token)`` pairs to probe, their descriptions, and problems.

    The first mismatching active token of each sample in sample order, then the second of each,
    ... up to ``budget - controls``; then matching active tokens as controls (all of the budget
    when nothing mismatches)."""
    from pytest_rlkernel_matrix.judge.read.evidence import read_evidence

    ev = read_evidence(run_dir)
    problems = list(ev.problems) + list(ev.sample_problems)
    samples = sorted(ev.samples, key=lambda s: (s.rank, s.sample))
    mism: list[list[int]] = []
    match: list[list[int]] = []
    for s in samples:
        active = [j for j in range(len(s.mask)) if float(s.mask[j]) > 0]
        mism.append([j for j in active if s.train[j].tobytes() != s.rollout[j].tobytes()])
        match.append([j for j in active if s.train[j].tobytes() == s.rollout[j].tobytes()])
    chosen: list[tuple[int, int]] = []
    about: list[dict[str, Any]] = []
    want_mis = max(0, budget - controls) if any(mism) else 0

    def pick(lists: list[list[int]], limit: int, kind: str) -> None:
        depth = 0
        while len(chosen) < limit and any(depth < len(x) for x in lists):
            for s, js in zip(samples, lists, strict=True):
                key = (int(s.sample), js[depth]) if depth < len(js) else None
                if key is not None and key not in chosen and len(chosen) < limit:
                    chosen.append(key)
                    about.append({"sample": key[0], "token": key[1], "kind": kind,
                                  "sidecar_train_logprob": float(s.train[key[1]]),
                                  "sidecar_rollout_logprob": float(s.rollout[key[1]])})
            depth += 1

    pick(mism, want_mis, "mismatch")
    pick(match, budget, "control")
    pick(mism, budget, "mismatch")  # no (or too few) matching tokens: the budget on mismatches
    if not samples:
        problems.append("no sidecar samples in the measured run: no tokens to probe")
    return chosen, about, problems


# ---------------------------------------------------------------------------------------------
# Reading.


def _load(path: Path, root: Path, problems: list[str]) -> dict[str, Any] | None:
    done = read_pt_dict(path, root, MAX_PROBE_BYTES, problems, "probe ")
    return None if done is None else done[0]


def _check(data: dict[str, Any], name: str) -> tuple[list[tuple[int, int]], dict[str, Any],
                                                      Any, list[str]]:
    """(token keys, outputs, log_softmax, operators) of one probe file; ValueError if malformed."""
    import torch

    if data.get("schema_version") != PROBE_SCHEMA:
        raise ValueError(f"schema_version {data.get('schema_version')!r}, expected "
                         f"{PROBE_SCHEMA!r}")
    tokens = data.get("tokens")
    if not isinstance(tokens, list) or len(tokens) > MAX_TOKENS:
        raise ValueError(f"tokens: expected a list of at most {MAX_TOKENS}")
    keys = []
    for i, t in enumerate(tokens):
        if not isinstance(t, dict):
            raise ValueError(f"tokens[{i}]: not a dict")
        for k in ("sample", "token", "position", "token_id"):
            if not isinstance(t.get(k), int) or isinstance(t.get(k), bool) or t[k] < 0:
                raise ValueError(f"tokens[{i}].{k}: expected an int >= 0")
        keys.append((t["sample"], t["position"]))
    ops = data.get("operators")
    if (not isinstance(ops, list) or len(ops) > MAX_OPERATORS
            or not all(isinstance(o, str) for o in ops)):
        raise ValueError("operators: expected a list of names")
    outputs = data.get("outputs")
    if not isinstance(outputs, dict):
        raise ValueError("outputs: expected a dict of operator name -> tensor")
    for op, t in outputs.items():
        if not isinstance(op, str) or not isinstance(t, torch.Tensor):
            raise ValueError(f"outputs[{op!r}]: expected a tensor")
        if t.dim() != 2 or t.shape[0] != len(keys):
            raise ValueError(f"outputs[{op!r}]: shape {tuple(t.shape)}, expected "
                             f"[{len(keys)} tokens, width]")
    lsm = data.get("log_softmax")
    if not isinstance(lsm, torch.Tensor):
        raise ValueError("log_softmax: expected a tensor")
    if keys and (lsm.dim() != 2 or lsm.shape[0] != len(keys)):
        raise ValueError(f"log_softmax: shape {tuple(lsm.shape)}, expected [{len(keys)}, vocab]")
    return keys, outputs, lsm, ops


def read_probes(probe_dir: Path, root: Path | None = None) -> tuple[dict[str, Any], list[str]]:
    """Per side: ``tokens`` {key: token dict}, ``ops`` {key: {op: tensor}}, ``lsm`` {key: row},
    ``operators`` (forward order), ``meta``; plus problems (each names the file)."""
    import torch

    root = root or probe_dir
    problems: list[str] = []
    sides: dict[str, Any] = {}
    index_path = probe_dir / "index.json"
    index: Any = None
    if index_path.exists():
        try:
            index = json.loads(read_bytes(index_path, root, MAX_INDEX_BYTES))
            if not isinstance(index, dict):
                raise ValueError("not an object")
            expected = index.get("files")
            if isinstance(expected, list):
                for f in expected:
                    if isinstance(f, str) and not (probe_dir / f).exists():
                        problems.append(f"probe index.json names {f}, which is absent")
        except (Refused, ValueError, UnicodeDecodeError) as exc:
            problems.append(f"probe index.json: unreadable: {exc}")
    else:
        problems.append(f"{probe_dir.name}/index.json is absent")
    for path in listing(probe_dir, "*.pt", root, problems):
        m = _FILE_RE.match(path.name)
        if not m:
            problems.append(f"probe {path.name}: not <side>.rank<00000>.pt: not read")
            continue
        data = _load(path, root, problems)
        if data is None:
            continue
        try:
            keys, outputs, lsm, ops = _check(data, path.name)
            if data.get("side") != m.group(1):
                raise ValueError(f"side {data.get('side')!r} differs from the file name")
        except (ValueError, TypeError) as exc:
            problems.append(f"probe {path.name}: malformed: {exc}")
            continue
        side = sides.setdefault(m.group(1), {"tokens": {}, "ops": {}, "lsm": {},
                                             "operators": ops, "meta": data, "files": []})
        side["files"].append(path.name)
        problems.extend(_against_index(index, path.name, keys, ops))
        for r, key in enumerate(keys):
            row = {op: t[r] for op, t in outputs.items()}
            if key in side["ops"]:  # a TP replica (or a CP rank) holding the same token
                old = side["ops"][key]
                if set(old) != set(row) or any(not torch.equal(old[o], row[o]) for o in row):
                    problems.append(f"probe {path.name}: token {key} differs from the same "
                                    f"token in {side['files'][0]} (TP replicas disagree)")
                continue
            side["ops"][key] = row
            side["tokens"][key] = data["tokens"][r]
            if lsm.numel():
                side["lsm"][key] = lsm[r]
    return sides, problems


def _against_index(index: Any, name: str, keys: list[tuple[int, int]],
                   ops: list[str]) -> list[str]:
    """A probe file holds every token and operator `index.json` lists (every rank taps the same
    rows; a replica that holds fewer was truncated): what it lacks, as reasons."""
    if not isinstance(index, dict):
        return []
    out: list[str] = []
    tokens = index.get("tokens")
    if isinstance(tokens, list):
        want = {(t.get("sample"), t.get("position")) for t in tokens if isinstance(t, dict)}
        lost = sorted(k for k in want - set(keys) if all(isinstance(x, int) for x in k))
        if lost:
            out.append(f"probe {name}: holds {len(set(keys) & want)} of the {len(want)} tokens "
                       f"index.json lists (lacks (sample, position) {lost[:4]}): truncated")
    listed = index.get("operators")
    if isinstance(listed, list) and listed != ops:
        lost_ops = [o for o in listed if o not in ops]
        out.append(f"probe {name}: operators differ from index.json's"
                   + (f" (lacks {lost_ops[:4]})" if lost_ops else ""))
    return out


# ---------------------------------------------------------------------------------------------
# Comparing.


def _label(module: str | None, cases: dict[str, Any], perturb: Any) -> tuple[list[str], str]:
    """Which side(s) an operator's divergence is put on, and the words for it."""
    if isinstance(perturb, dict) and perturb.get("side") in SIDES:
        s = perturb["side"]
        return [s], f"{s}, perturbation drill on {perturb.get('module_path')}"
    case = str(cases.get(module or "", "")) if module else ""
    if "/" in case:
        t, r = case.split("/", 1)
        if t != r:
            side = "training" if t == "P" else "rollout"
            return [side], f"{side} {'P' if side == 'training' else r}"
        return list(SIDES), f"both sides {case}"
    return list(SIDES), "both sides"


def _vocab(lt: Any, lr: Any) -> dict[str, Any]:
    """Full-vocabulary figures of one token (float64)."""
    import torch

    a, b = lt.double(), lr.double()
    pa, pb = a.exp(), b.exp()
    kl_rt = float(torch.where(pb > 0, pb * (b - a), torch.zeros_like(pb)).sum())
    kl_tr = float(torch.where(pa > 0, pa * (a - b), torch.zeros_like(pa)).sum())
    k = min(TOP_K, a.numel())
    ta, tb = set(a.topk(k).indices.tolist()), set(b.topk(k).indices.tolist())
    return {"kl_rollout_train": kl_rt, "kl_train_rollout": kl_tr,
            "total_variation": float(0.5 * (pa - pb).abs().sum()),
            "top1_agree": int(a.argmax()) == int(b.argmax()),
            "topk_overlap": len(ta & tb) / k}


def localise(probe_dir: Path, root: Path | None = None,
             chosen: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The ``localisation`` block of a cell from its probe directory (see the module docstring).

    ``chosen``: what ``probe_positions`` said of each probed token (kind, sidecar logprobs).
    ``no_divergence`` only when at least one operator was compared on every probed token and
    nothing was left out (no reason at all): a probe that compared nothing, or whose inputs
    are incomplete, is ``incomparable`` with the reasons. Never raises for what it reads."""
    try:
        return _localise(probe_dir, root, chosen)
    except Exception as exc:  # an unforeseen shape: the probe is not judged, the cell still is
        why = f"probe analysis failed: {type(exc).__name__}: {str(exc)[:300]}"
        out: dict[str, Any] = {"probe_dir": probe_dir.name, "reasons": [why], "operators": [],
                               "first_divergent": None, "per_layer": [], "growth": None,
                               "vocab": None, "tokens": [], "status": "incomparable"}
        out["summary"] = summary_line(out)
        return out


def _localise(probe_dir: Path, root: Path | None,
              chosen: list[dict[str, Any]] | None) -> dict[str, Any]:
    import torch

    sides, reasons = read_probes(probe_dir, root)
    out: dict[str, Any] = {"probe_dir": probe_dir.name, "reasons": reasons, "operators": [],
                           "first_divergent": None, "per_layer": [], "growth": None,
                           "vocab": None, "tokens": []}
    missing = [s for s in SIDES if s not in sides]
    if missing:
        reasons.append(f"no probe of the {' and '.join(missing)} side: nothing to compare")
        out["status"] = "incomparable"
        out["summary"] = f"probe incomparable: {reasons[-1]}"
        return out
    tr, ro = sides["training"], sides["rollout"]
    meta = tr["meta"]
    cases = meta.get("cases") if isinstance(meta.get("cases"), dict) else {}
    perturb = meta.get("perturb")
    keys = [k for k in tr["ops"] if k in ro["ops"]]
    for k in sorted(set(tr["ops"]) ^ set(ro["ops"])):
        reasons.append(f"token (sample {k[0]}, position {k[1]}) probed on "
                       f"{'training' if k in tr['ops'] else 'rollout'} side only")
    if not keys:
        reasons.append("no token probed on both sides")
        out["status"] = "incomparable"
        out["summary"] = "probe incomparable: no token probed on both sides"
        return out
    order = list(dict.fromkeys([*tr["operators"], *ro["operators"]]))
    tapped = list(dict.fromkeys(op for d in (tr, ro) for k in keys for op in d["ops"][k]))
    for op in tapped:  # an output no `operators` list names is compared too, and said
        if op not in order:
            order.append(op)
            reasons.append(f"{op}: has outputs but is not in the probe's operators list")
    if not order:
        reasons.append("no operator to compare: the probe's operators and outputs are empty")
    first: dict[str, Any] | None = None
    for op in order:
        entry: dict[str, Any] = {"name": op, "layer": operator_layer(op),
                                 "module": operator_module(op)}
        have = [s for s, d in (("training", tr), ("rollout", ro))
                if all(op in d["ops"][k] for k in keys)]
        if len(have) < 2:
            lacking = [s for s in SIDES if s not in have]
            entry["status"] = "incomparable"
            entry["reason"] = f"missing on the {' and '.join(lacking)} side"
            reasons.append(f"{op}: {entry['reason']}")
            out["operators"].append(entry)
            continue
        widths = {(s, tuple(d["ops"][k][op].shape), d["ops"][k][op].dtype)
                  for s, d in (("training", tr), ("rollout", ro)) for k in keys}
        if len({(w[1], w[2]) for w in widths if w[0] == "training"}) > 1 or len(
                {(w[1], w[2]) for w in widths if w[0] == "rollout"}) > 1:
            entry["status"] = "incomparable"
            entry["reason"] = ("rows of different widths or dtypes across tokens (files): "
                               f"{sorted({str(w[1]) for w in widths})[:4]}")
            reasons.append(f"{op}: {entry['reason']}")
            out["operators"].append(entry)
            continue
        a = torch.stack([tr["ops"][k][op] for k in keys])
        b = torch.stack([ro["ops"][k][op] for k in keys])
        entry["dtypes"] = {"training": str(a.dtype).replace("torch.", ""),
                           "rollout": str(b.dtype).replace("torch.", "")}
        if a.shape != b.shape:
            entry["status"] = "incomparable"
            entry["reason"] = f"shapes differ: training {tuple(a.shape)}, rollout {tuple(b.shape)}"
            reasons.append(f"{op}: {entry['reason']}")
            out["operators"].append(entry)
            continue
        bitwise = a.dtype == b.dtype and torch.equal(a, b)
        d = (a.double() - b.double()).abs()
        scale = float(torch.maximum(a.double().abs(), b.double().abs()).max())
        max_abs = float(d.max()) if d.numel() else 0.0
        entry.update(status="compared", bitwise=bitwise, max_abs=max_abs,
                     rel_err=max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf))
        if not bitwise and first is None:
            sides_, words = _label(entry["module"], cases, perturb)
            first = {"operator": op, "layer": entry["layer"], "module": entry["module"],
                     "sides": sides_, "label": words, "max_abs": max_abs,
                     "rel_err": entry["rel_err"]}
        out["operators"].append(entry)
    out["first_divergent"] = first
    layers: dict[int, float] = {}
    for e in out["operators"]:
        if e.get("status") == "compared" and e["layer"] is not None:
            layers[e["layer"]] = max(layers.get(e["layer"], 0.0), e["rel_err"])
    out["per_layer"] = [{"layer": i, "max_rel_err": v} for i, v in sorted(layers.items())]
    if first is not None and first["layer"] is not None and layers:
        last = max(layers)
        start = layers.get(first["layer"], 0.0)
        out["growth"] = {"from_layer": first["layer"], "to_layer": last, "from_rel": start,
                         "to_rel": layers[last],
                         "factor": layers[last] / start if start > 0 else None}
    _vocab_block(out, tr, ro, keys, chosen or [], reasons)
    compared = [e for e in out["operators"] if e.get("status") == "compared"]
    out["status"] = "localised" if first is not None else (
        "no_divergence" if compared and not reasons else "incomparable")
    if first is None and not compared and "nothing compared" not in " ".join(reasons):
        reasons.append("nothing compared: no operator was compared on both sides")
    out["summary"] = summary_line(out)
    return out


def _vocab_block(out: dict[str, Any], tr: dict[str, Any], ro: dict[str, Any],
                 keys: list[tuple[int, int]], chosen: list[dict[str, Any]],
                 reasons: list[str]) -> None:
    about = {(c["sample"], c["token"]): c for c in chosen if isinstance(c, dict)}
    per: list[dict[str, Any]] = []
    for k in keys:
        tok = tr["tokens"][k]
        row: dict[str, Any] = {"sample": k[0], "position": k[1], "token": tok["token"],
                               "token_id": tok["token_id"]}
        c = about.get((k[0], tok["token"]))
        if c is not None:
            row["kind"] = c.get("kind")
            row["sidecar_train_logprob"] = c.get("sidecar_train_logprob")
            row["sidecar_rollout_logprob"] = c.get("sidecar_rollout_logprob")
        lt, lr = tr["lsm"].get(k), ro["lsm"].get(k)
        if lt is None or lr is None or lt.shape != lr.shape:
            reasons.append(f"token (sample {k[0]}, position {k[1]}): full-vocabulary "
                           "log-softmax missing or of different widths")
            per.append(row)
            continue
        row.update(_vocab(lt, lr))
        tid = tok["token_id"]
        if tid < lt.numel():
            row["probe_train_logprob"] = float(lt[tid])
            row["probe_rollout_logprob"] = float(lr[tid])
            if c is not None:
                row["ties_to_sidecar"] = (row["probe_train_logprob"]
                                          == c.get("sidecar_train_logprob")
                                          and row["probe_rollout_logprob"]
                                          == c.get("sidecar_rollout_logprob"))
                if not row["ties_to_sidecar"]:
                    reasons.append(f"token (sample {k[0]}, token {tok['token']}): the probe "
                                   "run's logprobs differ from the measured run's sidecar")
        per.append(row)
    out["tokens"] = per
    done = [r for r in per if "kl_rollout_train" in r]
    if done:
        n = len(done)
        out["vocab"] = {
            "tokens": n, "top_k": TOP_K,
            "kl_rollout_train_mean": sum(r["kl_rollout_train"] for r in done) / n,
            "kl_train_rollout_mean": sum(r["kl_train_rollout"] for r in done) / n,
            "kl_rollout_train_max": max(r["kl_rollout_train"] for r in done),
            "total_variation_mean": sum(r["total_variation"] for r in done) / n,
            "top1_agreement": sum(r["top1_agree"] for r in done) / n,
            "topk_overlap_mean": sum(r["topk_overlap"] for r in done) / n,
        }


def summary_line(loc: dict[str, Any]) -> str:
    """``first divergent model.layers.0.self_attn.attn (training P), grows x30 by layer 27``."""
    first = loc.get("first_divergent")
    if loc.get("status") != "no_divergence" and first is None:
        return "probe incomparable: " + "; ".join(loc.get("reasons", [])[:2])
    if first is None:
        return "no divergence: every operator bitwise equal at the probed tokens"
    text = f"first divergent {first['operator']} ({first['label']})"
    g = loc.get("growth")
    if g and g.get("factor") is not None and g["to_layer"] != g["from_layer"]:
        word = "grows" if g["factor"] >= 1 else "shrinks to"
        text += f", {word} x{g['factor']:.3g} by layer {g['to_layer']}"
    v = loc.get("vocab")
    if v:
        text += (f"; vocab KL(r||t) {v['kl_rollout_train_mean']:.3g}, "
                 f"top-1 agree {v['top1_agreement']:.0%}")
    return text


# ---------------------------------------------------------------------------------------------
# The probe run: a separate run of a finished cell, in its own directory.


def drifts(record: dict[str, Any]) -> bool:
    """A cell whose sidecars show train/rollout logprob differences (value or bits)."""
    return any(isinstance(record.get(k), int) and record[k] > 0
               for k in ("mismatch_count", "bitwise_mismatch_count"))


# Verdicts whose run did not complete the cell's requested path: a probe of it would localise
# something else than the cell names (or a half-finished run), so none is started.
NO_PROBE_VERDICTS = ("error", "unsupported", "fallback", "not_run")
PROBE_NOTE = "probe-note.json"


def probe_refusal(record: dict[str, Any]) -> str | None:
    """Why a cell gets no probe run though probing was asked for; None: it may be probed.

    A probe run follows only a cell whose run completed (exit 0, not timed out) with a verdict
    that judged the requested path; ``drifts`` then says whether there is anything to localise."""
    if record.get("timed_out"):
        return "the cell's run timed out (its sidecars may be partial)"
    code = record.get("exit_code")
    if code is None:
        return "the cell's run did not start or was not recorded with an exit code"
    if code != 0:
        return f"the cell's run exited {code}"
    verdict = record.get("verdict")
    if verdict in NO_PROBE_VERDICTS:
        why = next((str(r) for r in record.get("reasons") or [] if isinstance(r, str)), "")
        return f"the cell is {verdict}" + (f" ({why[:200]})" if why else "")
    return None


def probe_plan(record: dict[str, Any], launcher: str = "local") -> str | None:
    """After a cell, with probing asked for: ``"probe"`` (start a probe run), None (it completed
    without drift: nothing to localise), or why no probe run may follow (for the note)."""
    why = probe_refusal(record)
    if why is None and not drifts(record):
        return None
    if why is None and launcher != "local":
        why = f"probe runs use the local launcher; this matrix uses {launcher!r}"
    return why or "probe"


def write_probe_note(run_dir: Path, why: str, write: Any = None) -> dict[str, Any]:
    """``<run dir>/probe-note.json``: no probe run, and why (the record's ``localisation``)."""
    from pytest_rlkernel_matrix.store.atomic import write_json_atomic

    note: dict[str, Any] = {
        "status": "not_run", "probe_run": None, "operators": [], "first_divergent": None,
        "per_layer": [], "growth": None, "vocab": None, "tokens": [],
        "reasons": [f"no probe run: {why}; a probe run follows only a completed run that "
                    "drifted"],
        "summary": f"no probe run: {why}"}
    (write or write_json_atomic)(run_dir / PROBE_NOTE, note)
    return note


def new_probe_dir(run_dir: Path) -> Path:
    """``<run dir>/probe``, else ``probe.2``, ...: never an existing one."""
    return new_dir(run_dir, "probe")


def probe_cell(run_dir: Path, *, command: str | list[str], cwd: Path, env: dict[str, str],
               timeout: float, budget: int = 8, controls: int = 2,
               write: Any = None) -> dict[str, Any]:
    """Run the cell's command again as a probe run and judge it; the ``localisation`` block.

    ``env`` is the measured run's process env; the probe run gets its own artifact directory
    (``new_probe_dir``), one step (no warmup), and ``RL_KERNEL_PROBE*``. ``write(path, obj)``
    writes JSON (the session's scrubbing writer); default: ``store.atomic.write_json_atomic``."""
    from pytest_rlkernel_matrix.run.runner import ARTIFACT_SUBDIRS, run_cell_command
    from pytest_rlkernel_matrix.store.atomic import write_json_atomic

    write = write or write_json_atomic
    positions, about, problems = probe_positions(run_dir, budget, controls)
    pdir = new_probe_dir(run_dir)
    for sub in ARTIFACT_SUBDIRS.values():
        (pdir / sub).mkdir(exist_ok=True)
    penv = {**env, "RL_KERNEL_ARTIFACT_DIR": str(pdir),
            **{var: str(pdir / sub) for var, sub in ARTIFACT_SUBDIRS.items()},
            "RL_KERNEL_PROBE": "1", "RL_KERNEL_PROBE_DIR": str(pdir / "probes"),
            "RL_KERNEL_PROBE_TOKENS": str(budget),
            "RL_KERNEL_PROBE_POSITIONS": ",".join(f"{i}:{j}" for i, j in positions),
            "RL_KERNEL_MATRIX_WARMUP": "0", "RL_KERNEL_MATRIX_REPEATS": "1",
            "RL_KERNEL_RUN_ID": env.get("RL_KERNEL_RUN_ID", run_dir.name) + "-probe"}
    result = run_cell_command(command, cwd=cwd, env=penv, timeout=timeout, artifact_dir=pdir,
                              raise_on_interrupt=True)
    rel = pdir.name
    write(pdir / "cell-run.json", {
        "probe": True, "excluded_from_performance": True, "probe_of": run_dir.name,
        "run": result.as_dict(), "positions": [list(p) for p in positions], "tokens": about,
        "env": {k: penv[k] for k in sorted(penv) if k.startswith("RL_KERNEL_PROBE")}})
    if result.exit_code != 0:
        loc: dict[str, Any] = {
            "status": "incomparable", "operators": [], "first_divergent": None,
            "per_layer": [], "growth": None, "vocab": None, "tokens": [],
            "reasons": [*problems, f"the probe run exited {result.exit_code}"
                        f"{' (timed out)' if result.timed_out else ''}: see {rel}/run.log"]}
        loc["summary"] = summary_line(loc)
    else:
        loc = localise(pdir / "probes", root=run_dir, chosen=about)
        loc["reasons"] = problems + loc["reasons"]
        if problems and loc.get("status") == "no_divergence":  # inputs incomplete: no pass
            loc["status"] = "incomparable"
            loc["summary"] = summary_line(loc)
    loc["probe_run"] = rel
    loc["probe_dir"] = f"{rel}/probes"
    write(pdir / "localisation.json", loc)
    return loc
