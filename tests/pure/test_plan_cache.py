"""The plan cache (capuchin_tf.policy.plan_cache): keys and digests, store/load round trip, unusable entries, atomic
writes."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import warnings

import pytest

from capuchin_tf.core import synthetic
from capuchin_tf.policy import make_plan
from capuchin_tf.policy.plan_cache import ENTRY_KIND, ENTRY_SCHEMA_VERSION, CacheKey, PlanCache, PlanCacheWarning

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def plan():
    trace = synthetic.linear_chain(3)
    p = make_plan(trace, synthetic.budget_fraction(trace, 0.5), "capuchin")
    assert p.swaps and p.recomputes  # the round trip covers both kinds of decision
    return p


def make_key(**changes) -> CacheKey:
    fields = dict(
        graph_fingerprint="f" * 16,
        input_signature="(TensorSpec(shape=(64, 1024), dtype=float32),)",
        budget_bytes=1 << 30,
        policy="capuchin",
        link="native",
        tf_version="2.21.0",
        options={"collective": True, "peak_fraction": 0.9},
    )
    fields.update(changes)
    return CacheKey(**fields)


def load_recording(cache: PlanCache, key: CacheKey):
    """cache.load(key) and every warning it emitted."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        result = cache.load(key)
    return result, record


# ---- CacheKey --------------------------------------------------------------------------------------------------


def test_equal_keys_have_equal_digests():
    a, b = make_key(), make_key()
    assert a == b and hash(a) == hash(b)
    assert a.digest() == b.digest()
    assert len(a.digest()) == 64 and int(a.digest(), 16) >= 0


@pytest.mark.parametrize(
    "field, value",
    [
        ("graph_fingerprint", "0" * 16),
        ("input_signature", "(TensorSpec(shape=(32, 1024), dtype=float32),)"),
        ("budget_bytes", (1 << 30) + 1),
        ("policy", "swap_only"),
        ("link", "p100"),
        ("tf_version", "2.21.1"),
        ("options", {"collective": False, "peak_fraction": 0.9}),
        ("options", {"collective": True}),
        ("options", ()),
    ],
)
def test_each_field_changes_the_digest(field, value):
    assert make_key(**{field: value}).digest() != make_key().digest()


def test_options_are_sorted_pairs_whatever_their_order():
    forms = [
        {"peak_fraction": 0.9, "collective": True},
        {"collective": True, "peak_fraction": 0.9},
        [("peak_fraction", 0.9), ("collective", True)],
        (("collective", True), ("peak_fraction", 0.9)),
    ]
    keys = [make_key(options=o) for o in forms]
    assert all(k.options == (("collective", True), ("peak_fraction", 0.9)) for k in keys)
    assert len({k.digest() for k in keys}) == 1


def test_digest_is_sha256_of_the_canonical_json():
    key = CacheKey("g\u00e9", "sig", 1024, "capuchin", "native", "2.21.0", options={"b": 2, "a": 1.5})
    canonical = (
        '{"budget_bytes":1024,"capuchin_tf_version":"","graph_fingerprint":"g\\u00e9","input_signature":"sig",'
        '"link":"native","options":[["a",1.5],["b",2]],"policy":"capuchin","tf_version":"2.21.0","variables":""}'
    )
    assert key.digest() == hashlib.sha256(canonical.encode("ascii")).hexdigest()


def test_digest_is_stable_across_processes():
    code = (
        "import sys; sys.modules['tensorflow'] = None; sys.modules['keras'] = None\n"
        "from capuchin_tf.policy.plan_cache import CacheKey\n"
        "k = CacheKey('f' * 16, 'sig', 1 << 30, 'capuchin', 'native', '2.21.0', options={'z': 'x', 'a': None})\n"
        "assert not {'tensorflow', 'keras'} & {m.split('.')[0] for m in sys.modules if sys.modules[m] is not None}\n"
        "print(k.digest())\n"
    )
    expected = CacheKey("f" * 16, "sig", 1 << 30, "capuchin", "native", "2.21.0", options={"a": None, "z": "x"})
    for seed in ("0", "4242"):
        env = dict(os.environ, CAPUCHIN_TF_PURE="1", PYTHONHASHSEED=seed)
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == expected.digest()


def test_key_json_round_trip():
    key = make_key(options={"min_candidate_bytes": None, "early_recompute": True, "max_rounds": 64})
    d = json.loads(json.dumps(key.to_json()))
    assert d["options"] == [["early_recompute", True], ["max_rounds", 64], ["min_candidate_bytes", None]]
    back = CacheKey.from_json(d)
    assert back == key and back.digest() == key.digest()


def test_key_from_json_rejects_unknown_and_missing_fields():
    d = make_key().to_json()
    with pytest.raises(ValueError, match="unknown CacheKey fields"):
        CacheKey.from_json({**d, "batch": 64})
    del d["policy"]
    with pytest.raises(KeyError):
        CacheKey.from_json(d)


@pytest.mark.parametrize(
    "field, value", [("budget_bytes", 1.0), ("budget_bytes", True), ("budget_bytes", "1GiB"), ("policy", None),
                     ("tf_version", 2.21)]
)
def test_key_field_types_are_checked(field, value):
    with pytest.raises(TypeError, match=f"CacheKey.{field} must be"):
        make_key(**{field: value})


# ---- store / load ----------------------------------------------------------------------------------------------


def test_store_then_load_round_trip(tmp_path, plan):
    cache = PlanCache(tmp_path / "nested" / "cache")  # created on demand
    key = make_key()
    path = cache.store(key, plan, extra={"measured_peak_bytes": 123})
    assert path == cache.path_for(key) == tmp_path / "nested" / "cache" / f"{key.digest()}.json"
    entry = json.loads(path.read_text())
    assert entry == {
        "kind": ENTRY_KIND,
        "schema_version": ENTRY_SCHEMA_VERSION,
        "key": json.loads(json.dumps(key.to_json())),
        "plan": json.loads(json.dumps(plan.to_json())),
        "extra": {"measured_peak_bytes": 123},
    }
    loaded, record = load_recording(cache, key)
    assert record == []
    assert loaded.to_json() == plan.to_json()
    assert loaded == plan


def test_store_without_extra_and_overwrite(tmp_path, plan):
    cache = PlanCache(tmp_path)
    key = make_key()
    cache.store(key, plan, extra={"a": 1})
    other = dataclasses.replace(plan, policy="replaced")
    path = cache.store(key, other)
    assert json.loads(path.read_text())["extra"] == {}
    assert cache.load(key).policy == "replaced"
    assert cache.entries() == [path]


def test_missing_entry_is_none_without_warning(tmp_path):
    for directory in (tmp_path, tmp_path / "does-not-exist"):
        result, record = load_recording(PlanCache(directory), make_key())
        assert result is None and record == []


def test_atomic_write_leaves_no_temporary_files(tmp_path, plan):
    cache = PlanCache(tmp_path)
    paths = {cache.store(make_key(budget_bytes=b), plan) for b in (1 << 28, 1 << 29, 1 << 30)}
    cache.store(make_key(budget_bytes=1 << 30), plan)  # replacing an entry
    assert set(tmp_path.iterdir()) == paths


def test_failed_write_keeps_the_old_entry_and_no_temporary_file(tmp_path, plan, monkeypatch):
    cache = PlanCache(tmp_path)
    key = make_key()
    path = cache.store(key, plan)
    before = path.read_bytes()

    def failing_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk full"):
        cache.store(key, dataclasses.replace(plan, policy="new"))
    assert list(tmp_path.iterdir()) == [path]
    assert path.read_bytes() == before


def _valid_entry(key, plan) -> dict:
    return {"kind": ENTRY_KIND, "schema_version": ENTRY_SCHEMA_VERSION, "key": key.to_json(), "plan": plan.to_json(),
            "extra": {}}


def _with(d: dict, **changes) -> dict:
    return {**d, **changes}


BAD_ENTRIES = {
    "not JSON": (lambda e: b"{not json", "not valid JSON"),
    "empty file": (lambda e: b"", "not valid JSON"),
    "truncated": (lambda e: json.dumps(e, indent=1).encode()[:-200], "not valid JSON"),
    "not UTF-8": (lambda e: b"\xff\xfe\x00garbage", "not valid JSON"),
    "a list": (lambda e: b"[1, 2]", "not a plan cache entry"),
    "a bare plan": (lambda e: json.dumps(e["plan"]).encode(), "not a plan cache entry"),
    "wrong kind": (lambda e: json.dumps(_with(e, kind="something.else")).encode(), "not a plan cache entry"),
    "newer schema": (lambda e: json.dumps(_with(e, schema_version=9)).encode(), "schema version 9 is not supported"),
    "no schema": (lambda e: json.dumps({k: v for k, v in e.items() if k != "schema_version"}).encode(),
                  "schema version None is not supported"),
    "no key": (lambda e: json.dumps({k: v for k, v in e.items() if k != "key"}).encode(), "malformed key"),
    "key not a dict": (lambda e: json.dumps(_with(e, key=42)).encode(), "malformed key"),
    "key with a bad type": (lambda e: json.dumps(_with(e, key=_with(e["key"], budget_bytes="1GiB"))).encode(),
                            "malformed key"),
    "other key": (lambda e: json.dumps(_with(e, key=_with(e["key"], budget_bytes=5, link="p100"))).encode(),
                  "stale entry: its key differs from the requested one in budget_bytes, link"),
    "no plan": (lambda e: json.dumps({k: v for k, v in e.items() if k != "plan"}).encode(), "malformed plan"),
    "plan not a dict": (lambda e: json.dumps(_with(e, plan=[])).encode(), "malformed plan"),
    "plan of another schema": (lambda e: json.dumps(_with(e, plan=_with(e["plan"], schema_version=9))).encode(),
                               "malformed plan (PlanError: plan schema version 9 is not supported"),
    "plan missing a field": (lambda e: json.dumps(_with(e, plan={k: v for k, v in e["plan"].items()
                                                                   if k != "predicted_step_s"})).encode(),
                             "malformed plan (KeyError: 'predicted_step_s')"),
    "plan with a bad decision": (lambda e: json.dumps(_with(e, plan=_with(e["plan"], decisions=[{"kind": "x"}])))
                                 .encode(), "malformed plan (PlanError: decision of None: unknown kind 'x'"),
}


@pytest.mark.parametrize("case", sorted(BAD_ENTRIES))
def test_unusable_entry_is_a_miss_with_one_warning(tmp_path, plan, case):
    make_bytes, reason = BAD_ENTRIES[case]
    cache = PlanCache(tmp_path)
    key = make_key()
    path = cache.path_for(key)
    path.write_bytes(make_bytes(_valid_entry(key, plan)))
    result, record = load_recording(cache, key)
    assert result is None
    assert len(record) == 1
    w = record[0]
    assert w.category is PlanCacheWarning and issubclass(PlanCacheWarning, UserWarning)
    assert str(path) in str(w.message) and reason in str(w.message)
    assert w.filename == __file__  # attributed to the caller of load
    assert path.exists()  # the cache leaves the file for inspection; the next store replaces it
    cache.store(key, plan)
    assert load_recording(cache, key) == (plan, [])


def test_entry_copied_under_another_key_is_stale(tmp_path, plan):
    cache = PlanCache(tmp_path)
    stored, wanted = make_key(), make_key(policy="swap_only")
    shutil.copy(cache.store(stored, plan), cache.path_for(wanted))
    result, record = load_recording(cache, wanted)
    assert result is None and len(record) == 1
    assert "stale entry" in str(record[0].message) and "in policy" in str(record[0].message)
    assert load_recording(cache, stored) == (plan, [])


def test_unreadable_entry_is_a_miss_with_one_warning(tmp_path):
    cache = PlanCache(tmp_path)
    key = make_key()
    cache.path_for(key).mkdir()  # a directory where the file should be
    result, record = load_recording(cache, key)
    assert result is None and len(record) == 1
    assert "cannot be read" in str(record[0].message) and str(cache.path_for(key)) in str(record[0].message)


# ---- entries / clear -------------------------------------------------------------------------------------------


def test_entries_and_clear_touch_only_cache_entries(tmp_path, plan):
    cache = PlanCache(tmp_path)
    assert PlanCache(tmp_path / "missing").entries() == []
    assert PlanCache(tmp_path / "missing").clear() == 0
    paths = [cache.store(make_key(budget_bytes=b), plan) for b in (3 << 20, 1 << 20, 2 << 20)]
    others = [tmp_path / "notes.txt", tmp_path / "plan.json", tmp_path / f".{paths[0].stem}.abc.tmp"]
    for p in others:
        p.write_text("{}")
    assert cache.entries() == sorted(paths)
    assert cache.clear() == 3
    assert cache.entries() == []
    assert sorted(tmp_path.iterdir()) == sorted(others)
    assert cache.load(make_key(budget_bytes=1 << 20)) is None
