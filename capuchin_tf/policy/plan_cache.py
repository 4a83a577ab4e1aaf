"""A directory of plans, so that a restarted training job reuses its plan instead of re-running the measured execution.

Pure Python: imports no TensorFlow.

A plan is valid for one graph, input signature, budget, policy (with its options), link and TensorFlow version; a
`CacheKey` holds them and its `digest()` (sha256 of a canonical JSON form) names the entry's file, ``<digest>.json``.
Entries are written atomically (a temporary file in the same directory, then ``os.replace``), so a reader never sees
half a file. A file that cannot be used (unreadable, not JSON, another kind or schema version, a key that differs from
the one asked for, a malformed plan) is a cache miss: `PlanCache.load` warns once with `PlanCacheWarning`, naming the
file and the reason, and returns None.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import operator
import os
import pathlib
import re
import tempfile
import warnings
from collections.abc import Mapping

from capuchin_tf.core.plan import Plan, options_tuple

ENTRY_KIND = "capuchin_tf.PlanCacheEntry"
ENTRY_SCHEMA_VERSION = 2  # 2: the key holds the capuchin_tf version and the variables' dtypes and shapes

_ENTRY_NAME = re.compile(r"[0-9a-f]{64}\.json")
_STR_FIELDS = ("graph_fingerprint", "input_signature", "policy", "link", "tf_version", "capuchin_tf_version",
               "variables")


class PlanCacheWarning(UserWarning):
    """A plan cache entry was ignored because it cannot be used (the message names the file and the reason)."""


class _BadEntry(Exception):
    """Why an entry file cannot be used (internal: `PlanCache.load` turns it into a PlanCacheWarning)."""


def _canonical(value: object) -> str:
    """Compact JSON with sorted keys and ASCII only: the same text for the same value in every process."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


@dataclasses.dataclass(frozen=True)
class CacheKey:
    """Everything a plan depends on. `options` (a mapping or (name, value) pairs) is stored as sorted pairs.

    `graph_fingerprint`: the step's graph with every node's attributes (capture.graph_fingerprint), so that another
    model, or the same model with other hyperparameters, misses; `variables`: the dtypes and shapes of the captured
    variables, in capture order."""

    graph_fingerprint: str
    input_signature: str
    budget_bytes: int
    policy: str
    link: str
    tf_version: str
    options: tuple[tuple[str, object], ...] = ()
    capuchin_tf_version: str = ""
    variables: str = ""

    def __post_init__(self) -> None:
        for name in _STR_FIELDS:
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"CacheKey.{name} must be a str, got {getattr(self, name)!r}")
        if isinstance(self.budget_bytes, bool) or not hasattr(type(self.budget_bytes), "__index__"):
            raise TypeError(f"CacheKey.budget_bytes must be an int, got {self.budget_bytes!r}")
        object.__setattr__(self, "budget_bytes", operator.index(self.budget_bytes))
        object.__setattr__(self, "options", options_tuple(self.options))

    def to_json(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["options"] = [list(pair) for pair in self.options]
        return d

    @classmethod
    def from_json(cls, d: Mapping) -> CacheKey:
        """Inverse of `to_json`; raises KeyError, TypeError or ValueError on malformed input."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = set(d) - set(names)
        if unknown:
            raise ValueError(f"unknown CacheKey fields {sorted(unknown)}")
        return cls(**{name: d[name] for name in names if name != "options"}, options=d.get("options", ()))

    def digest(self) -> str:
        """sha256 (hex) of the canonical JSON of the fields: stable across processes, machines and Python versions."""
        return hashlib.sha256(_canonical(self.to_json()).encode("ascii")).hexdigest()


class PlanCache:
    """Plans stored as ``<key digest>.json`` files in `directory` (created on the first `store`)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = pathlib.Path(directory)

    def path_for(self, key: CacheKey) -> pathlib.Path:
        return self.directory / f"{key.digest()}.json"

    def store(self, key: CacheKey, plan: Plan, extra: dict | None = None) -> pathlib.Path:
        """Writes the entry for `key` atomically (replacing any previous one) and returns its path."""
        entry = {
            "kind": ENTRY_KIND,
            "schema_version": ENTRY_SCHEMA_VERSION,
            "key": key.to_json(),
            "plan": plan.to_json(),
            "extra": extra or {},
        }
        text = json.dumps(entry, indent=1)
        path = self.path_for(key)
        self.directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{path.stem}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            pathlib.Path(tmp).unlink(missing_ok=True)
            raise
        return path

    def load(self, key: CacheKey) -> Plan | None:
        """The plan stored for `key`; None if there is none or, with one PlanCacheWarning, if its file is unusable."""
        entry = self._load(key)
        return None if entry is None else entry[0]

    def load_entry(self, key: CacheKey) -> tuple[Plan, dict] | None:
        """The plan stored for `key` and the `extra` stored with it; None as for `load`."""
        return self._load(key)

    def _load(self, key: CacheKey) -> tuple[Plan, dict] | None:
        path = self.path_for(key)
        try:
            return _read_entry(path, key)
        except FileNotFoundError:
            return None
        except OSError as e:
            reason = f"cannot be read ({e})"
        except _BadEntry as e:
            reason = str(e)
        warnings.warn(f"ignoring plan cache entry {path}: {reason}", PlanCacheWarning, stacklevel=3)
        return None

    def entries(self) -> list[pathlib.Path]:
        """The entry files in the directory, sorted (other files are not the cache's and are left alone)."""
        if not self.directory.is_dir():
            return []
        return sorted(p for p in self.directory.iterdir() if _ENTRY_NAME.fullmatch(p.name))

    def clear(self) -> int:
        """Deletes every entry file; returns how many were deleted."""
        paths = self.entries()
        for p in paths:
            p.unlink(missing_ok=True)
        return len(paths)


def _read_entry(path: pathlib.Path, key: CacheKey) -> tuple[Plan, dict]:
    data = path.read_bytes()
    try:
        entry = json.loads(data)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise _BadEntry(f"not valid JSON ({e})") from None
    if not isinstance(entry, dict) or entry.get("kind") != ENTRY_KIND:
        raise _BadEntry(f"not a plan cache entry (kind is not {ENTRY_KIND!r})")
    if entry.get("schema_version") != ENTRY_SCHEMA_VERSION:
        raise _BadEntry(
            f"schema version {entry.get('schema_version')!r} is not supported (this is {ENTRY_SCHEMA_VERSION})"
        )
    try:
        stored = CacheKey.from_json(entry["key"])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise _BadEntry(f"malformed key ({type(e).__name__}: {e})") from None
    if stored.digest() != key.digest():
        want, have = key.to_json(), stored.to_json()
        differing = [name for name in want if _canonical(want[name]) != _canonical(have[name])]
        raise _BadEntry(f"stale entry: its key differs from the requested one in {', '.join(differing)}")
    try:
        plan = Plan.from_json(entry["plan"])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise _BadEntry(f"malformed plan ({type(e).__name__}: {e})") from None
    extra = entry.get("extra", {})
    if not isinstance(extra, dict):
        raise _BadEntry("malformed extra (not an object)")
    return plan, extra
