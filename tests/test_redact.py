"""Secrets by value out of every file a session writes; one file mode for every report file."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from pytest_rlkernel_matrix.store.atomic import file_mode, write_json_atomic, write_text_atomic
from pytest_rlkernel_matrix.store.redact import REDACTED, Scrubber, is_secret, secret_values


@contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


@pytest.mark.parametrize("name, secret", [
    ("HF_TOKEN", True), ("WANDB_API_KEY", True), ("DB_PASSWORD", True), ("GH_PAT", True),
    ("DATABASE_URL", True), ("AWS_SECRET_ACCESS_KEY", True), ("hf-token", True),
    ("TOKENIZERS_PARALLELISM", False), ("MAX_NUM_BATCHED_TOKENS", False), ("PATH", False),
    ("VLLM_USE_V1", False), ("SPATIAL", False),
])
def test_secret_names(name: str, secret: bool) -> None:
    assert is_secret(name) is secret


def test_secret_values_from_env_and_command() -> None:
    env = {"HF_TOKEN": "hf_abcdef", "MIRROR_URL": "https://u1:pw_mirror@mirror.example/simple",
           "USE_AUTH": "1", "SHORT_KEY": "abc", "AUTH_ENABLED": "true", "PLAIN": "visible"}
    command = ('export GITLAB_TOKEN=inline_one; API_KEY="inline two" python train.py '
               "--hf-token opt_one --api-key=opt_two --max-tokens 4096 "
               "--db postgres://dbu:dbpw_x@db/x")
    values = secret_values(env, command)
    assert values == {"hf_abcdef", "u1:pw_mirror", "pw_mirror", "inline_one", "inline two",
                      "opt_one", "opt_two", "dbu:dbpw_x", "dbpw_x"}


def test_scrubber_replaces_values_longest_first_and_url_credentials() -> None:
    scrub = Scrubber(["secret", "secret_long", "abc", "1234", "false"])
    text = "a secret_long and a secret, abc, 1234, false, https://x:y@host/p"
    assert scrub.text(text) == (f"a {REDACTED} and a {REDACTED}, abc, 1234, false, "
                                f"https://{REDACTED}@host/p")
    assert scrub.obj({"k": ["secret", 3, None, {"secret": ("secret",)}]}) == {
        "k": [REDACTED, 3, None, {REDACTED: [REDACTED]}]}


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o077])
def test_atomic_writes_follow_the_umask(tmp_path: Path, mask: int) -> None:
    from pytest_rlkernel_matrix.report.html import write_html

    with umask(mask):
        assert file_mode() == 0o666 & ~mask
        write_json_atomic(tmp_path / "a.json", {"x": 1})
        write_text_atomic(tmp_path / "b.txt", "x")
        write_html({"cells": [], "summary": {}, "matrix": {}}, tmp_path / "c.html")
        plain = tmp_path / "d.txt"
        plain.write_text("x")
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert modes == dict.fromkeys(("a.json", "b.txt", "c.html", "d.txt"), 0o666 & ~mask)


SECRETS = {
    "env": "hf_envsecret_4242",
    "runner_env": "apikey_value_1234",
    "pat": "ghpat_abcdef5555",
    "database": "dbpass_9876",
    "url": "mirrorpass_2468",
    "inline": "inline_secret_7777",
    "option": "opt_secret_5555",
    "hook": "hook_secret_3131",
}
LEAKY = r"""#!/bin/bash
all="$HF_TOKEN $MY_API_KEY $GH_PAT $DATABASE_URL $MIRROR_URL $GITLAB_TOKEN $SITE_SECRET $*"
echo "RuntimeError: CUDA error: device-side assert with $all"
echo "[RL-Kernel][route] module=attention side=rollout fallback=true reason=$all"
echo "Traceback (most recent call last):"
echo "ValueError: bad credentials $all"
exit 3
"""


def test_no_secret_value_in_any_written_file(pytester: pytest.Pytester, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A secret in the environment, the matrix file's env, the command line (inline and as an
    option), a hook's env and a URL reaches run.log and from there every copied line: none of
    the files the session writes holds one, nor the terminal; all of them share one mode."""
    script = pytester.path / "leaky.sh"
    script.write_text(LEAKY)
    script.chmod(0o755)
    command = f"GITLAB_TOKEN={SECRETS['inline']} {script} --api-key {SECRETS['option']}"
    pytester.makefile(".toml", matrix=(
        f'[matrix]\nmodules = ["attention"]\n[runner]\ncommand = "{command}"\ntimeout = 60\n'
        f'env = {{ MY_API_KEY = "{SECRETS["runner_env"]}", GH_PAT = "{SECRETS["pat"]}", '
        f'DATABASE_URL = "postgres://dbuser:{SECRETS["database"]}@db.example/x", '
        f'MIRROR_URL = "https://mirroruser:{SECRETS["url"]}@mirror.example/simple" }}\n'
        '[hardware.cpu]\nbackend = "cpu"\n'))
    pytester.makeconftest(f"""
        def pytest_rlk_cell_env(config, cell, env):
            env["SITE_SECRET"] = "{SECRETS['hook']}"
    """)
    monkeypatch.setenv("HF_TOKEN", SECRETS["env"])
    root = tmp_path / "root"
    with umask(0o027):
        result = pytester.runpytest(f"--rlk-matrix-root={root}", "-k", "R/R", "--rlk-plan",
                                    "--rlk-hardware=cpu")
        plan = result.stdout.str()
        result = pytester.runpytest(f"--rlk-matrix-root={root}", "-k", "R/R")
    run_dir = root / "cpu" / "attention-rr"
    log = (run_dir / "run.log").read_text()
    assert all(value in log for value in SECRETS.values())  # the job really printed them
    record = json.loads((run_dir / "cell-record.json").read_text())
    assert record["log_errors"] and record["fallbacks"] and record["reasons"]
    assert REDACTED in json.dumps(record["log_errors"]) + json.dumps(record["fallbacks"])
    written = [p for p in root.rglob("*") if p.is_file()]
    assert {"matrix-report.json", "matrix-report.html", "cell-record.json", "cell-run.json",
            "matrix-case.env", "preflight.json"} <= {p.name for p in written}
    leaks = {(str(p.relative_to(root)), name) for p in written if p.name != "run.log"
             for name, value in SECRETS.items() if value in p.read_text(errors="replace")}
    assert not leaks
    terminal = plan + result.stdout.str() + result.stderr.str()
    assert not [name for name, value in SECRETS.items() if value in terminal]
    case_env = (run_dir / "matrix-case.env").read_text()
    assert f"export SITE_SECRET='{REDACTED}'" in case_env and f"GITLAB_TOKEN={REDACTED}" in case_env
    modes = {str(p.relative_to(root)): oct(stat.S_IMODE(p.stat().st_mode)) for p in written}
    assert set(modes.values()) == {oct(0o640)}, modes
