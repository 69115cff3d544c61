"""What names a fallback: one definition for run.log lines (`logscan`) and records
(`route.rules`).

RL-Kernel's `_contains_fallback` (`rl_engine/integrations/common/runtime.py` @a5a92ecf) counts a
mapping key that, stripped and lower-cased, is `fallback`, `fallback_used`, `split_kv_fallback` or
`used_fallback`, holding a value `not in (False, None, "", 0)`, anywhere in a record. This judge
is that rule and wider, never narrower (tests/test_fallback_words.py checks it against upstream's
answers, `tests/data/fallback/upstream.json`):

- a key names a fallback when its words, in any case or compound form (`usedFallback`,
  `Split-KV-Fallback`, `attention_fallback`, `fallbackUsed`, `fall_back`), hold the word
  `fallback` (or `fall` + `back`), unless one of its words says the key is a setting rather than
  an event (`allow_fallback`, `fallback_policy`, `disable_fallback`: `SETTING_WORDS`);
- a record's value is truthy as upstream says (`not in (False, None, "", 0)`: the string
  ``"false"`` is a fallback in a record, as it is upstream); a log line's value is text, and is
  false only when it spells false (`FALSE_TEXT`: ``false``, ``0``, ``none``, ``no``, ``off`` ...).
"""

from __future__ import annotations

import itertools
import re
from typing import Any

# Words that make a fallback key a setting (what may happen), not a report (what did happen).
SETTING_WORDS = frozenset({"allow", "allowed", "allows", "enable", "enabled", "permit",
                           "permitted", "disable", "disabled", "policy", "policies", "forbid",
                           "forbidden", "no", "never", "strict", "max", "limit", "mode"})
# A log line's value that says "no fallback" (case-folded, trailing punctuation removed).
FALSE_TEXT = frozenset({"false", "0", "0.0", "none", "null", "no", "off", "", "''", '""'})

_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")
_SPLIT = re.compile(r"[^a-z0-9]+")


def key_words(key: object) -> list[str]:
    """The words of a key: camelCase split, lower-cased, split at anything not a letter or
    digit (`usedFallback` -> used, fallback; `split-kv.Fallback` -> split, kv, fallback)."""
    text = _CAMEL.sub("_", str(key).strip())
    return [w for w in _SPLIT.split(text.lower()) if w]


def names_fallback(key: object) -> bool:
    """Whether `key` names a fallback event (module doc): upstream's four keys and every case or
    compound form of one holding the word `fallback`; a setting's key is not one."""
    words = key_words(key)
    squashed = "".join(words)
    said = ("fallback" in squashed or "fallbacks" in squashed
            or any(a == "fall" and b == "back" for a, b in itertools.pairwise(words)))
    if not said:
        return False
    if any(w in SETTING_WORDS for w in words):
        return False
    return not (squashed.startswith(("allow", "enable", "permit", "disable", "nofallback"))
                or squashed.endswith(("policy", "allowed", "enabled", "permitted", "mode",
                                      "limit")))


def truthy_value(value: Any) -> bool:
    """RL-Kernel's rule for a record's value: `value not in (False, None, "", 0)` (so 0.0 is
    false, NaN, ``"false"``, ``[]`` and ``{}`` are true, as upstream has them)."""
    try:
        return value not in (False, None, "", 0)
    except Exception:  # an object whose == raises: not provably false
        return True


def truthy_text(text: str) -> bool:
    """A log line's value: true unless it spells false (`FALSE_TEXT`)."""
    return text.strip().rstrip(",;)]}").strip().casefold() not in FALSE_TEXT


_KV = re.compile(r"([\w.\-]+)['\"]?\s*[=:]\s*(\"[^\"]*\"|'[^']*'|[^\s,;]*)")


def fallback_in_text(line: str) -> str | None:
    """The first `key=value` (or `key: value`) of a log line whose key names a fallback and
    whose value does not spell false, as `key=value`; None when none does."""
    if "fall" not in line.lower():
        return None
    for m in _KV.finditer(line):
        key, value = m.group(1), m.group(2)
        if names_fallback(key) and truthy_text(value.strip("\"'")):
            return f"{key}={value}"
    return None
