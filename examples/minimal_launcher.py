"""A complete minimal vime-style launcher: every artifact pytest-rlkernel-matrix reads, no more.

Run it through the plugin (from the repository root; CPU, about ten seconds a cell):

    pytest --rlk-matrix=examples/minimal.toml

What it is: one process stands in for a vime job (rollout engine + training actor). A tiny
decoder (embedding, one attention block, one SwiGLU FFN, lm_head) does real RL steps: the
rollout side samples responses token by token with a KV cache, the training side recomputes the
log-probabilities of those tokens over the whole sequence and takes a policy-gradient step, and
the new weights are "exported" to the rollout side for the next step. Per module (attention,
FFN, selected logprob `logp`) each side runs either

- R: the aligned kernel, here a row-wise implementation whose result for one position does not
  depend on how many positions are computed with it, so both sides get the same bits (in a real
  launcher: RL-Kernel's operator; report the backend id RL-Kernel's provider returns), or
- P: the production path, here batched matrix products on the training side and one-row decode
  products (with `scaled_dot_product_attention`) on the rollout side, as the two engines do.

What it writes under $RL_KERNEL_ARTIFACT_DIR (the directories are the contract's
`RL_KERNEL_*_DIR` variables; docs/artifact-format.md, "Writing a launcher", has the table of
required and optional keys: the plugin's readers decide, this file follows them):

    readbacks/{megatron-training,vllm-rollout}-<pid>.json   one per process and side
    mismatch-sidecars/rank00000.call<step:08d>.pt           one per step (call 0, 1, ...)
    weight-audit/weight_v<k:06d>.json                       training rank 0, one per version
    weight-audit/rollout/weight_v<k:06d>.json               optional: what the rollout loaded
    manifest.json                                           optional: run id, batch size
    stdout (the plugin saves it as run.log): route lines, the native logp marker, vime's
    `rollout N: {...}`, `perf N: {...}` and `step N: {...}` records

Only the standard library and torch. Nothing here imports the plugin.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

MODULES = ("attention", "ffn", "logp")
FRAMEWORK = {"training": "megatron", "rollout": "vllm"}  # readback file names and route lines
# Stand-ins for RL-Kernel's backend ids: the plugin treats `rlkernel.*` as an RL-Kernel backend.
R_BACKEND = {"attention": "rlkernel.attention.example_rowwise.v1",
             "ffn": "rlkernel.ffn.example_rowwise.v1",
             "logp": "rlkernel.linear_logp.example_rowwise.v1"}
R_CONTRACT_VERSION = "example.rowwise.bitwise.v1"
SIDECAR_SCHEMA = "rlkernel.vime_rocm_attention_mismatch_sidecar.v1"
VOCAB, DIM, HEADS, HIDDEN, MAX_POS = 48, 32, 2, 64, 64
SAMPLES_PER_STEP = 4  # global batch size: responses per step


# -- the model ------------------------------------------------------------------------------


def init_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).requires_grad_()

    d = DIM ** -0.5
    return {
        "model.embed_tokens.weight": rand(VOCAB, DIM, scale=1.0),
        "model.embed_positions.weight": rand(MAX_POS, DIM, scale=0.1),
        "model.layers.0.input_layernorm.weight": torch.ones(DIM).requires_grad_(),
        "model.layers.0.self_attn.q_proj.weight": rand(DIM, DIM, scale=d),
        "model.layers.0.self_attn.k_proj.weight": rand(DIM, DIM, scale=d),
        "model.layers.0.self_attn.v_proj.weight": rand(DIM, DIM, scale=d),
        "model.layers.0.self_attn.o_proj.weight": rand(DIM, DIM, scale=d),
        "model.layers.0.post_attention_layernorm.weight": torch.ones(DIM).requires_grad_(),
        "model.layers.0.mlp.gate_proj.weight": rand(DIM, HIDDEN, scale=d),
        "model.layers.0.mlp.up_proj.weight": rand(DIM, HIDDEN, scale=d),
        "model.layers.0.mlp.down_proj.weight": rand(HIDDEN, DIM, scale=HIDDEN ** -0.5),
        "model.norm.weight": torch.ones(DIM).requires_grad_(),
        "lm_head.weight": rand(DIM, VOCAB, scale=d),
    }


def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def rowwise(fn, x: torch.Tensor) -> torch.Tensor:
    """R: one position at a time, so a position's bits never depend on the batch it is in."""
    return torch.stack([fn(x[i]) for i in range(x.shape[0])])


class Side:
    """One side's kernels (R or P per module), with RL-Kernel-style call counts."""

    def __init__(self, side: str, letters: dict[str, str], w: dict[str, torch.Tensor]) -> None:
        self.side, self.letters, self.w = side, letters, w
        self.calls = dict.fromkeys(MODULES, 0)

    def attention(self, h: torch.Tensor, cache: dict[str, list[torch.Tensor]] | None,
                  start: int) -> torch.Tensor:
        """Rows `start..start+len(h)-1` of the sequence; `cache` holds K/V of earlier rows."""
        self.calls["attention"] += 1
        p = "model.layers.0."
        w = self.w
        hd = DIM // HEADS
        if self.letters["attention"] == "R":
            a = rowwise(lambda r: rms(r, w[p + "input_layernorm.weight"]), h)
            q, k, v = (rowwise(lambda r, n=n: r @ w[p + f"self_attn.{n}_proj.weight"], a)
                       for n in "qkv")
        else:
            a = rms(h, w[p + "input_layernorm.weight"])
            q, k, v = (a @ w[p + f"self_attn.{n}_proj.weight"] for n in "qkv")
        if cache is not None:
            cache["k"].append(k)
            cache["v"].append(v)
            k, v = torch.cat(cache["k"]), torch.cat(cache["v"])
        n_k = k.shape[0]
        q, k, v = (t.view(t.shape[0], HEADS, hd) for t in (q, k, v))
        if self.letters["attention"] == "R":
            def one(i: int) -> torch.Tensor:  # query row `start + i` sees keys 0..start+i
                t = start + i + 1
                heads = []
                for j in range(HEADS):
                    s = (k[:t, j] @ q[i, j]) / math.sqrt(hd)
                    heads.append(torch.softmax(s, -1) @ v[:t, j])
                return torch.cat(heads)
            out = torch.stack([one(i) for i in range(q.shape[0])])
            out = rowwise(lambda r: r @ w[p + "self_attn.o_proj.weight"], out)
        else:
            mask = (torch.arange(n_k)[None, :] <= (start + torch.arange(q.shape[0]))[:, None])
            if self.side == "rollout":  # the engine's fused attention over the KV cache
                out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                                     v.transpose(0, 1), attn_mask=mask)
                out = out.transpose(0, 1).reshape(q.shape[0], DIM)
            else:  # training: the whole causal matrix at once
                s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
                s = s.masked_fill(~mask, float("-inf"))
                out = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v).reshape(-1, DIM)
            out = out @ w[p + "self_attn.o_proj.weight"]
        return h + out

    def ffn(self, h: torch.Tensor) -> torch.Tensor:
        self.calls["ffn"] += 1
        p = "model.layers.0."
        w = self.w

        def mlp(x: torch.Tensor) -> torch.Tensor:
            x = rms(x, w[p + "post_attention_layernorm.weight"])
            gate, up = x @ w[p + "mlp.gate_proj.weight"], x @ w[p + "mlp.up_proj.weight"]
            return (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"]

        return h + (rowwise(mlp, h) if self.letters["ffn"] == "R" else mlp(h))

    def logp(self, h: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """log p(tokens[i] | row i): the selected logprob (lm_head + log_softmax + gather)."""
        self.calls["logp"] += 1
        w = self.w

        def lp(x: torch.Tensor) -> torch.Tensor:
            return torch.log_softmax(rms(x, w["model.norm.weight"]) @ w["lm_head.weight"], -1)

        full = rowwise(lp, h) if self.letters["logp"] == "R" else lp(h)
        return full.gather(-1, tokens[:, None])[:, 0]

    def hidden(self, ids: torch.Tensor, start: int, cache=None) -> torch.Tensor:
        w = self.w
        h = (w["model.embed_tokens.weight"][ids]
             + w["model.embed_positions.weight"][start:start + len(ids)])
        return self.ffn(self.attention(h, cache, start))


# -- one RL step ----------------------------------------------------------------------------


def rollout(side: Side, prompts: list[list[int]], lengths: list[int], g: torch.Generator):
    """vLLM's part: prefill, then decode one token at a time over the KV cache."""
    out = []
    with torch.no_grad():
        for prompt, n_new in zip(prompts, lengths, strict=True):
            cache: dict[str, list[torch.Tensor]] = {"k": [], "v": []}
            h = side.hidden(torch.tensor(prompt), 0, cache)[-1:]
            tokens, logps = [], []
            for j in range(n_new):
                probs = torch.softmax(
                    rms(h[0], side.w["model.norm.weight"]) @ side.w["lm_head.weight"], -1)
                tok = int(torch.multinomial(probs, 1, generator=g))
                logps.append(side.logp(h, torch.tensor([tok]))[0])
                tokens.append(tok)
                if j + 1 < n_new:
                    h = side.hidden(torch.tensor([tok]), len(prompt) + j, cache)
            out.append((tokens, torch.stack(logps)))
    return out


def train_logprobs(side: Side, prompt: list[int], response: list[int]) -> torch.Tensor:
    """Megatron's part: recompute the response's logprobs over the whole sequence."""
    ids = torch.tensor(prompt + response)
    h = side.hidden(ids, 0)
    first = len(prompt) - 1  # the logit at position t predicts token t + 1
    return side.logp(h[first:first + len(response)], ids[first + 1:])


# -- artifacts ------------------------------------------------------------------------------


def write_json(path: Path, data: object) -> None:
    """Atomic: the plugin may read a directory while a run is still writing it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
    os.replace(tmp, path)


def weight_audit(weights: dict[str, torch.Tensor], version: str, scope: str) -> dict:
    """RL-Kernel's weight audit: sha256 of each tensor's bytes, and the sha256 of the UTF-8
    bytes of `json.dumps(tensors, sort_keys=True)` (json's default separators `", "` and
    `": "`, ASCII escapes: exactly the call below)."""
    tensors = {}
    for name, t in weights.items():
        t = t.detach().contiguous()
        tensors[name] = {"sha256": hashlib.sha256(memoryview(t.view(torch.uint8).numpy()))
                         .hexdigest(), "shape": list(t.shape), "dtype": str(t.dtype)}
    digest = hashlib.sha256(json.dumps(tensors, sort_keys=True).encode("utf-8")).hexdigest()
    return {"version": version, "scope": scope, "sha256": digest,
            "tensor_count": len(tensors), "tensors": tensors}


def sync_weights(weights: dict[str, torch.Tensor], roll: Side, version: str,
                 audits: Path) -> None:
    """vime's update_weights: training rank 0 exports a version and audits it; the rollout
    engine loads it (here: the same tensors) and records what it loaded (optional evidence)."""
    write_json(audits / f"{version}.json", weight_audit(weights, version,
                                                          "all_exported_parameters"))
    roll.w = weights
    write_json(audits / "rollout" / f"{version}.json",
               weight_audit(roll.w, version, "rollout_loaded_parameters"))


def readback(side: Side, cases: dict[str, str], run_id: str, version: str) -> dict:
    """RL-Kernel's readback for one side: a hook and a record per module the side runs through
    RL-Kernel's integration (production modules included); none for native training logp."""
    fw = FRAMEWORK[side.side]
    hooks, operators = {}, {}
    for m in MODULES:
        letter = side.letters[m]
        if side.side == "training" and m == "logp" and letter == "P":
            continue  # native Megatron logp: no hook, no record; its marker line says it ran
        impl = "rl_kernel" if letter == "R" else "production"
        prov: dict[str, object] = {
            "interface": f"minimal_launcher.Side.{m}", "operator": m, "fallback": False,
            "execution": {"runtime_platform": "cpu", "triton_used": False,
                          "tp_world_size": 1, "cp_world_size": 1}}
        if impl == "rl_kernel":
            prov.update(arithmetic_contract="bitwise", contract_version=R_CONTRACT_VERSION)
        hooks[m] = f"minimal_launcher.Side.{m}"
        operators[m] = {"framework": fw, "target": side.side, "module": m, "case_id": cases[m],
                        "implementation": impl,
                        "backend_id": R_BACKEND[m] if impl == "rl_kernel"
                        else f"{fw}.production.{m}",
                        "call_count": side.calls[m], "execution_mode": "eager",
                        "provenance": prov}
    data = {"framework": fw, "target": side.side, "run_id": run_id,
            "plan": {"schema_version": "rlkernel.debug_matrix.v1",
                     "cases": {m: {"module": m, "case_id": cases[m],
                                   "training_implementation": _impl(cases[m][0]),
                                   "rollout_implementation": _impl(cases[m][2])}
                               for m in MODULES}},
            "installed_hooks": hooks, "fallbacks": [],
            "profile_calls": {m: side.calls[m] for m in hooks}, "operators": operators}
    if side.side == "rollout":
        data["weight_version"] = version  # the version the rollout engine last loaded
    return data


def _impl(letter: str) -> str:
    return "rl_kernel" if letter == "R" else "production"


def route_lines(side: Side) -> None:
    """RL-Kernel prints one per hooked module and side (rank 0); stdout is the cell's run.log."""
    fw = FRAMEWORK[side.side]
    for m in MODULES:
        letter = side.letters[m]
        if side.side == "training" and m == "logp" and letter == "P":
            print("linear_logp native active: backend_id=vime.utils.ppo_utils."
                  "calculate_log_probs_and_entropy contract_id=vime.native.linear_logp.v1 "
                  "route=unconfigured device=cpu", flush=True)
            continue
        actual = R_BACKEND[m] if letter == "R" else f"{fw}.production.{m}"
        print(f"[RL-Kernel][route] framework={fw} target={side.side} module={m} "
              f"requested={_impl(letter)} actual={actual} fallback=false", flush=True)


# -- the job --------------------------------------------------------------------------------


def main() -> int:
    env = os.environ
    art = Path(env["RL_KERNEL_ARTIFACT_DIR"])
    mode = env.get("RL_KERNEL_MODE", "strict")
    run_id = env.get("RL_KERNEL_RUN_ID", "")
    cases = {m: env.get(f"RL_KERNEL_{m.upper()}_CASE", "R/R").strip().upper() for m in MODULES}
    if mode == "off":  # RL-Kernel disabled: everything native, no readbacks, no route lines
        cases = dict.fromkeys(MODULES, "P/P")
    steps = int(env.get("RL_KERNEL_MATRIX_WARMUP", "1")) + int(
        env.get("RL_KERNEL_MATRIX_REPEATS", "3"))
    if env.get("RLK_MATRIX_THREADS"):
        torch.set_num_threads(int(env["RLK_MATRIX_THREADS"]))
    readbacks = Path(env.get("RL_KERNEL_READBACK_DIR", art / "readbacks"))
    sidecars = Path(env.get("RL_KERNEL_MISMATCH_SIDECAR_DIR", art / "mismatch-sidecars"))
    audits = Path(env.get("RL_KERNEL_WEIGHT_AUDIT_DIR", art / "weight-audit"))
    sidecars.mkdir(parents=True, exist_ok=True)
    print(f"minimal launcher: run {run_id} cases {cases} mode {mode} steps {steps}", flush=True)

    torch.manual_seed(0)
    weights = init_weights()
    train = Side("training", {m: cases[m][0] for m in MODULES}, weights)
    roll = Side("rollout", {m: cases[m][2] for m in MODULES}, weights)
    if mode != "off":
        for side in (train, roll):
            route_lines(side)
    write_json(art / "manifest.json", {
        "run_id": run_id, "runtime_platform": "cpu", "num_rollout": steps,
        "batching": {"global_batch_size": SAMPLES_PER_STEP}})
    g = torch.Generator().manual_seed(1234)
    version = "weight_v000000"
    sync_weights(weights, roll, version, audits)
    for step in range(steps):
        t0 = time.perf_counter()
        prompts = [[int(t) for t in torch.randint(1, VOCAB, (3 + (i + step) % 5,),
                                                   generator=g)]
                   for i in range(SAMPLES_PER_STEP)]
        lengths = [4 + (2 * i + step) % 6 for i in range(SAMPLES_PER_STEP)]
        sampled = rollout(roll, prompts, lengths, g)
        t1 = time.perf_counter()
        train_lp = [train_logprobs(train, p, toks) for p, (toks, _) in zip(prompts, sampled,
                                                                              strict=True)]
        roll_lp = [lp for _, lp in sampled]
        # A policy-gradient step: reward = share of even tokens, advantage = reward - mean.
        rewards = torch.tensor([sum(t % 2 == 0 for t in toks) / len(toks) for toks, _ in sampled])
        adv = rewards - rewards.mean()
        loss = -sum(a * lp.sum() for a, lp in zip(adv, train_lp, strict=True)) / sum(lengths)
        for t in weights.values():
            t.grad = None
        loss.backward()
        t2 = time.perf_counter()
        with torch.no_grad():
            for t in weights.values():
                if t.grad is not None:
                    t -= 0.05 * t.grad
        version = f"weight_v{step + 1:06d}"
        sync_weights(weights, roll, version, audits)
        t3 = time.perf_counter()

        # The logprob evidence: one sidecar per call of the mismatch hook (call_index from 0).
        tr = [t.detach().float() for t in train_lp]
        masks = [torch.ones(len(t)) for t in tr]  # loss mask: every response token counts
        tmp = sidecars / f".rank00000.call{step:08d}.pt.tmp"
        torch.save({"schema_version": SIDECAR_SCHEMA, "rank": 0, "call_index": step,
                    "tensor_parallel_size": 1, "context_parallel_size": 1,
                    "train_log_probs": tr, "rollout_log_probs": [t.float() for t in roll_lp],
                    "loss_masks": masks, "total_lengths": [len(p) + n for p, n in
                                                           zip(prompts, lengths, strict=True)],
                    "response_lengths": list(lengths)}, tmp)
        os.replace(tmp, sidecars / f"rank00000.call{step:08d}.pt")

        # vime's records (Python dict literals); per-sample means, as vime logs them.
        diffs = [(a - b).abs() for a, b in zip(tr, roll_lp, strict=True)]
        n = SAMPLES_PER_STEP
        tokens = sum(lengths)
        print(f"rollout {step}: " + repr({
            "rollout/response_lengths": tokens / n,
            "rollout/total_lengths": sum(len(p) for p in prompts) / n + tokens / n,
            "rollout/truncated_ratio": 0.0}), flush=True)
        print(f"step {step}: " + repr({
            "train/train_current_rollout_logprob_mismatch_count":
                sum(int((d != 0).sum()) for d in diffs) / n,
            "train/train_current_rollout_logprob_max_abs_diff":
                sum(float(d.max()) for d in diffs) / n,
            "train/train_current_rollout_logprob_numel": tokens / n,
            "train/train_rollout_logprob_abs_diff": sum(float(d.mean()) for d in diffs) / n,
            "train/loss": float(loss)}), flush=True)
        print(f"perf {step}: " + repr({
            "perf/rollout_time": t1 - t0, "perf/tokens_per_gpu_per_sec": tokens / (t1 - t0)}),
            flush=True)
        print(f"perf {step}: " + repr({
            "perf/step_time": t3 - t0, "perf/train_time": t2 - t1,
            "perf/actor_train_time": t2 - t1, "perf/update_weights_time": t3 - t2,
            "perf/actor_train_tok_per_s": tokens / (t2 - t1)}), flush=True)

    if mode != "off":  # RL-Kernel rewrites readbacks as calls accrue; final after a clean exit
        for side in (train, roll):
            write_json(readbacks / f"{FRAMEWORK[side.side]}-{side.side}-{os.getpid()}.json",
                       readback(side, cases, run_id, version))
    return 0


if __name__ == "__main__":
    sys.exit(main())
