"""Deterministic tiny Qwen3 checkpoint in Hugging Face format, written locally (no hub).

``python -m pytest_rlkernel_matrix.engines.checkpoint DIR`` writes ``config.json``,
``model.safetensors`` and a word-level ``tokenizer.json`` built with ``tokenizers`` into DIR
(atomically: a temporary sibling directory renamed into place). The same seed always gives the
same bytes, so the fingerprint (``preflight.fingerprint_model_dir``) is stable across machines.
The weights come from the built-in workload's ``init_weights`` (its ``tiny`` preset), so both
reference jobs share one model.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

DEFAULT_SEED = 1234
PRESET = "tiny"
MAX_POSITIONS = 512
CACHE_ENV = "RLK_ENGINES_CACHE"


def default_dir() -> Path:
    """``$RLK_ENGINES_CACHE`` or ``~/.cache/rlkernel-matrix``, then ``tiny-qwen3-s<seed>``."""
    root = os.environ.get(CACHE_ENV) or str(Path.home() / ".cache" / "rlkernel-matrix")
    return Path(root) / f"tiny-qwen3-s{DEFAULT_SEED}"


def hf_config(seed: int = DEFAULT_SEED) -> dict:
    """The ``config.json`` of the tiny Qwen3 (every key vLLM and transformers read)."""
    from pytest_rlkernel_matrix.workload.model import PRESETS

    cfg = PRESETS[PRESET]
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size,
        "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": cfg.eos_token_id,
        "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
        "max_position_embeddings": MAX_POSITIONS, "rope_scaling": None,
        "sliding_window": None, "use_sliding_window": False, "max_window_layers": 0,
        "torch_dtype": "bfloat16", "initializer_range": 0.02, "use_cache": True,
        "rlk_seed": seed,
    }


def build_tokenizer(vocab_size: int) -> object:
    """Word-level tokenizer: ``<bos>``, ``<eos>``, ``t2``..``t{V-1}`` (whitespace split)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<bos>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


def write_checkpoint(out: Path, seed: int = DEFAULT_SEED) -> Path:
    """Write the checkpoint into ``out`` unless it exists (never overwritten); return ``out``."""
    import torch
    from safetensors.torch import save_file

    from pytest_rlkernel_matrix.workload.model import PRESETS, init_weights

    out = Path(out)
    if (out / "model.safetensors").is_file():
        return out
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not a tiny-qwen3 checkpoint; not touching it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    cfg = hf_config(seed)
    weights = init_weights(PRESETS[PRESET], seed, torch.bfloat16, torch.device("cpu"))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp / "model.safetensors"),
              metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (tmp / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 0, "eos_token_id": cfg["eos_token_id"]}, indent=2) + "\n")
    build_tokenizer(cfg["vocab_size"]).save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>",
         "eos_token": "<eos>", "unk_token": "<eos>", "model_max_length": MAX_POSITIONS},
        indent=2) + "\n")
    try:
        os.rename(tmp, out)
    except OSError:
        if not (out / "model.safetensors").is_file():  # lost a race to a sibling writer: fine
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pytest_rlkernel_matrix.engines.checkpoint",
                                 description=__doc__)
    ap.add_argument("out", nargs="?", default=None, help=f"directory (default {default_dir()})")
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED)
    args = ap.parse_args(argv)
    out = write_checkpoint(Path(args.out) if args.out else default_dir(), args.seed)
    from pytest_rlkernel_matrix.machine.preflight import fingerprint_model_dir

    print(json.dumps({"path": str(out), **fingerprint_model_dir(out)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
