"""Secrets out of everything the plugin writes: by name and by value.

By name: a variable whose name looks secret (`is_secret`) is written as `<redacted>` in
`matrix-case.env`, `cell-run.json` and `--rlk-plan`.

By value: a `Scrubber` knows the *values* of the secrets a session can see and replaces them in
every string of a record, a report or an env file, wherever they turn up (a token echoed into
`run.log` and copied into `log_errors`, a fallback line, a reason, the command line):

- values of secret-named variables (`*TOKEN*`, `*KEY*`, `*SECRET*`, `*PASSWORD*`, `*PASSWD*`,
  `*CREDENTIAL*`, `*AUTH*`, `*_PAT`, `DATABASE_URL`) of the session's environment, the matrix
  file's `[runner] env` and profile `env`, and what `pytest_rlk_cell_env` adds;
- the `user:password` part of any URL with credentials (`scheme://user:pass@host`) in any
  variable, and in any copied line even when its value was never seen (pattern, not value);
- inline assignments in the command string (`HF_TOKEN=abc python train.py`,
  `export API_KEY=abc; ...`) and secret-named options (`--hf-token abc`, `--api-key=abc`).

Values shorter than `MIN_SECRET_LEN` (4) characters, numbers and booleans are not scrubbed by
value: `MAX_TOKENS=8` or `USE_AUTH=1` would otherwise blank every `8` or `1` in a report (their
names are still redacted). `run.log` itself is the job's own output, kept as written: treat a
matrix root as sensitive if the job prints secrets. `rlk-matrix report` (re-analysis) only knows
the secret values of its own environment; a secret the job printed and that `rlk-matrix report`'s
environment does not hold is scrubbed only when it has a URL-credential form.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

REDACTED = "<redacted>"
MIN_SECRET_LEN = 4

_SECRET_NAME_RE = re.compile(
    r"TOKEN|KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH|(?:^|_)PAT$|^DATABASE_URL$", re.IGNORECASE
)
# Names that match the words above but name no secret (counts, tokenizer settings).
_NOT_SECRET_RE = re.compile(r"TOKENIZER|TOKENS(?:_|$)", re.IGNORECASE)
_URL_CREDS_RE = re.compile(r"(?<=://)([^/\s@:'\"]+):([^/\s@'\"]+)(?=@)")
_ASSIGN_RE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.DOTALL)
_OPTION_RE = re.compile(r"^--?([A-Za-z][A-Za-z0-9_-]*)(?:=(.*))?$", re.DOTALL)
_BORING = {"true", "false", "none", "null", "yes", "no", "on", "off"}


def is_secret(name: str) -> bool:
    """Does this variable (or option) name look like it holds a secret?"""
    return bool(_SECRET_NAME_RE.search(name)) and not _NOT_SECRET_RE.search(name)


def _worth_scrubbing(value: str) -> bool:
    value = value.strip()
    if len(value) < MIN_SECRET_LEN or value.lower() in _BORING:
        return False
    try:
        float(value)
    except ValueError:
        return True
    return False


def url_credentials(value: str) -> list[str]:
    """`user:pass` and `pass` of every `scheme://user:pass@` in `value`."""
    out: list[str] = []
    for match in _URL_CREDS_RE.finditer(value):
        out += [f"{match.group(1)}:{match.group(2)}", match.group(2)]
    return out


def _command_words(command: str | Sequence[str]) -> list[str]:
    if not isinstance(command, str):
        return [str(w) for w in command]
    try:
        return shlex.split(command, comments=False)
    except ValueError:  # unbalanced quotes: fall back to whitespace words
        return command.split()


def command_secrets(command: str | Sequence[str]) -> list[str]:
    """Secret values written into the command itself."""
    words = _command_words(command)
    out: list[str] = []
    for i, word in enumerate(words):
        for part in re.split(r"[;&|]", word) if isinstance(command, str) else [word]:
            assign = _ASSIGN_RE.match(part)
            if assign and is_secret(assign.group(1)):
                out.append(assign.group(2))
        option = _OPTION_RE.match(word)
        if option and is_secret(option.group(1).replace("-", "_")):
            if option.group(2) is not None:
                out.append(option.group(2))
            elif i + 1 < len(words) and not words[i + 1].startswith("-"):
                out.append(words[i + 1])
        out += url_credentials(word)
    return out


def secret_values(env: Mapping[str, str] | None = None,
                  command: str | Sequence[str] | None = None) -> set[str]:
    """Values worth scrubbing from an environment and a command."""
    found: list[str] = []
    for name, value in (env or {}).items():
        if not isinstance(value, str):
            continue
        if is_secret(name):
            found.append(value)
        found += url_credentials(value)
    if command is not None:
        found += command_secrets(command)
    return {v for v in found if _worth_scrubbing(v)}


class Scrubber:
    """Replaces known secret values (and URL credentials) in strings and nested data."""

    def __init__(self, values: Iterable[str] = ()) -> None:
        self._values: set[str] = set()
        self._re: re.Pattern[str] | None = None
        self.add(values)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None,
                 command: str | Sequence[str] | None = None) -> Scrubber:
        return cls(secret_values(env, command))

    def add(self, values: Iterable[str]) -> None:
        new = {v for v in values if _worth_scrubbing(v)} - self._values
        if new:
            self._values |= new
            ordered = sorted(self._values, key=len, reverse=True)  # longest first
            self._re = re.compile("|".join(re.escape(v) for v in ordered))

    def add_env(self, env: Mapping[str, str],
                command: str | Sequence[str] | None = None) -> None:
        self.add(secret_values(env, command))

    def __len__(self) -> int:
        return len(self._values)

    def text(self, text: str) -> str:
        if self._re is not None:
            text = self._re.sub(REDACTED, text)
        if "://" in text:
            text = _URL_CREDS_RE.sub(REDACTED, text)
        return text

    def obj(self, data: Any) -> Any:
        """A copy of `data` (dicts, lists, tuples, strings) with every string scrubbed."""
        if isinstance(data, str):
            return self.text(data)
        if isinstance(data, Mapping):
            return {(self.text(k) if isinstance(k, str) else k): self.obj(v)
                    for k, v in data.items()}
        if isinstance(data, (list, tuple)):
            return [self.obj(v) for v in data]
        return data
