"""The benchmark models (capuchin_tf/cli/models.py): quick-tier models build, train, are deterministic across
processes, and list every variable their step touches. The standard and paper tiers are too slow for tests; `python
-m capuchin_tf bench run --policy tf --model M --batch B ...` runs any of them plain."""

import concurrent.futures
import math
import sys

import pytest
import tensorflow as tf

from capuchin_tf.cli import models

QUICK = ("mlp", "cnn", "transformer", "dropout-bn")
BATCH = 4


def test_registry_names_and_tiers():
    assert models.TIERS == {
        "quick": ("mlp", "cnn", "transformer", "dropout-bn"),
        "standard": ("resnet50", "vgg16", "inceptionv3", "densenet121", "bert-4l"),
        "paper": ("resnet152", "inceptionresnetv2", "bert-base"),
    }
    assert list(models.MODELS) == [n for names in models.TIERS.values() for n in names]
    assert all(models.MODELS[n] == "quick" for n in QUICK)
    table = models.describe()
    for name, tier in models.MODELS.items():
        assert name in table and tier in table


def test_unknown_name_and_bad_batch():
    with pytest.raises(ValueError, match="unknown model 'resnet9000'.*mlp.*bert-base"):
        models.build("resnet9000", 4)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="batch"):
            models.build("mlp", bad)


def test_bert_without_keras_hub_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "keras_hub", None)  # makes `import keras_hub` raise ImportError
    with pytest.raises(ImportError, match="pip install --no-deps -r tools/requirements-bert.txt"):
        models.build("bert-4l", 1)


@pytest.fixture(scope="module")
def quick_setups():
    return {name: models.build(name, BATCH) for name in QUICK}


@pytest.mark.parametrize("name", QUICK)
def test_quick_model_trains(quick_setups, name):
    s = quick_setups[name]
    assert s.name == name and s.batch == BATCH
    assert len(s.inputs) == len(s.input_spec)
    for t, spec in zip(s.inputs, s.input_spec):
        assert spec.is_compatible_with(t) and t.shape[0] == BATCH and spec.shape.is_fully_defined()
    assert s.train_step.input_signature == s.input_spec
    assert not s.train_step._jit_compile
    trainable_before = [v.numpy().copy() for v in s.model.trainable_variables[:2]]
    losses = [float(s.train_step(*s.inputs)) for _ in range(2)]
    assert all(math.isfinite(x) for x in losses), losses
    assert s.train_step.experimental_get_tracing_count() == 1  # traced in build, the calls did not retrace
    assert any((b != v.numpy()).any() for b, v in zip(trainable_before, s.model.trainable_variables[:2]))
    assert s.info["params"] == s.model.count_params() - s.info["non_trainable_params"]
    assert s.info["param_bytes"] == 4 * s.model.count_params()
    assert s.info["tier"] == "quick" and s.info["description"]


@pytest.mark.parametrize("name", QUICK)
def test_variables_are_exactly_the_steps_captures(quick_setups, name):
    s = quick_setups[name]
    graph = s.concrete_function().graph
    captured = {id(ext) for ext, _ in graph.captures if ext.dtype == tf.resource}
    assert captured == {id(v.handle) for v in s.variables}
    assert len(s.variable_roles) == len(s.variables)
    assert all(isinstance(v, tf.Variable) for v in s.variables)
    model_trainable = {id(v.value) for v in s.model.trainable_variables}
    assert model_trainable == {id(v) for v in s.variables_by_role("trainable")}
    opt = {id(v.value) for v in s.optimizer.variables}
    assert opt == {id(v) for v in s.variables_by_role("optimizer")}
    iteration = s.optimizer.iterations.value
    written = {id(v) for v in s.written_variables}
    assert id(iteration) in written and id(s.optimizer._learning_rate.value) not in written
    assert model_trainable <= written


def test_roles_per_model(quick_setups):
    for name in ("mlp", "cnn"):  # SGD without momentum: no slots, only the counter and the learning rate
        s = quick_setups[name]
        assert len(s.variables_by_role("optimizer")) == 2
        assert not s.variables_by_role("seed_generator") and not s.variables_by_role("non_trainable")

    bn = quick_setups["dropout-bn"]
    stats = bn.variables_by_role("non_trainable")
    assert len(stats) == 20 and all("moving_" in v.name for v in stats)  # 10 BatchNormalization layers
    seeds = bn.variables_by_role("seed_generator")
    assert len(seeds) == 4 and all("seed_generator_state" in v.name for v in seeds)  # 4 Dropout layers
    assert {id(v) for v in stats + seeds} <= {id(v) for v in bn.written_variables}

    tr = quick_setups["transformer"]  # Adam: a momentum and a velocity per trainable variable
    assert len(tr.variables_by_role("optimizer")) == 2 + 2 * len(tr.variables_by_role("trainable"))
    assert len(tr.variables_by_role("seed_generator")) == 7  # embeddings + 2 x (attention probs, attention, FFN)
    seed_before = [v.numpy().copy() for v in tr.variables_by_role("seed_generator")]
    tr.train_step(*tr.inputs)  # the step advances every seed generator (a state write)
    assert all((b != v.numpy()).any() for b, v in zip(seed_before, tr.variables_by_role("seed_generator")))


_DETERMINISM_CHILD = """
import hashlib, json, sys
sys.path.insert(0, {repo!r})
import tensorflow as tf
from capuchin_tf.cli import models
out = {{}}
for name in {names!r}:
    s = models.build(name, {batch})
    losses = [float(s.train_step(*s.inputs)).hex() for _ in range(3)]
    h = hashlib.sha256()
    for v in s.variables:
        h.update(v.numpy().tobytes())
    out[name] = {{"losses": losses, "variables": h.hexdigest()}}
print(json.dumps(out))
"""


def test_two_fresh_processes_give_bit_identical_losses(simulated_device):
    import pathlib

    repo = str(pathlib.Path(models.__file__).resolve().parent.parent)
    code = _DETERMINISM_CHILD.format(repo=repo, names=QUICK, batch=BATCH)
    # Children import only capuchin_tf.cli.models (CAPUCHIN_TF_PURE=1): the zoo needs no op library.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda _: simulated_device(code, 2048, env={"CAPUCHIN_TF_PURE": "1"}), range(2)))
    assert runs[0] == runs[1]
    assert set(runs[0]) == set(QUICK)
    for name, r in runs[0].items():
        losses = [float.fromhex(x) for x in r["losses"]]
        assert all(math.isfinite(x) for x in losses) and len(set(losses)) > 1, (name, losses)


# ---- initial values from another build (models.initial_values; the zoo's decorated runs) ---------------------------
def test_initial_values_replace_the_initializers_and_are_checked():
    with models.initial_values() as made:
        first = models.build("dropout-bn", BATCH)
    assert len(made) >= len(first.variables_by_role("trainable"))
    values = [v.numpy() + 1 for v in made]  # not what any initializer draws
    with models.initial_values(values) as loaded:
        second = models.build("dropout-bn", BATCH)
    assert len(loaded) == len(values)
    for v, value in zip(loaded, values):
        assert v.numpy().tobytes() == value.tobytes(), v.path
    trainable = second.variables_by_role("trainable")
    assert any(t.numpy().tobytes() == values[0].tobytes() for t in trainable)  # the model's own variable
    wrong_shape = list(values)
    wrong_shape[0] = values[0].reshape(-1)[:1]
    for bad, message in ((wrong_shape, "variable 1 .* the value"), (values[:-1], "more variables than values"),
                         (values + [values[0]], "more values than")):
        with pytest.raises(ValueError, match=message):
            with models.initial_values(bad):
                models.build("dropout-bn", BATCH)


_INITIAL_VALUES_CHILD = """
import hashlib, json, pickle, sys
sys.path.insert(0, {repo!r})
import numpy as np
import tensorflow as tf
import capuchin_tf  # the simulated device as the zoo runs it (its BFC splits every chunk to the request)
from capuchin_tf.cli import models
load = None
if {load!r}:
    with open({path!r}, "rb") as f:
        load = pickle.load(f)
tf.config.experimental.reset_memory_stats("CPU:0")
with models.initial_values(load) as made:
    s = models.build("dropout-bn", {batch})
info = tf.config.experimental.get_memory_info("CPU:0")
if not {load!r}:
    with open({path!r}, "wb") as f:
        pickle.dump([np.asarray(v.numpy()) for v in made], f)
h = hashlib.sha256()
for v in s.variables:
    h.update(v.numpy().tobytes())
losses = [float(s.train_step(*s.inputs)).hex()]
print(json.dumps({{"peak": info["peak"], "current": info["current"], "variables": h.hexdigest(), "losses": losses}}))
"""


def test_a_build_from_initial_values_runs_no_initializer_on_the_device(simulated_device, tmp_path):
    import pathlib

    repo = str(pathlib.Path(models.__file__).resolve().parent.parent)
    path = str(tmp_path / "initial.pkl")
    runs = [simulated_device(_INITIAL_VALUES_CHILD.format(repo=repo, load=load, path=path, batch=8), 2048)
            for load in (False, True)]
    built, loaded = runs
    # The same bits in, the same bits out; and building from host values takes no device memory beyond the variables
    # and the step's inputs (the initializers' random draws and their scaling are what the plain build adds).
    assert loaded["variables"] == built["variables"] and loaded["losses"] == built["losses"]
    assert loaded["current"] == built["current"]
    assert loaded["peak"] - loaded["current"] < built["peak"] - built["current"], (built, loaded)
