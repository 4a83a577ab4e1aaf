"""Planning a BERT-base-sized trace (about 10,000 tensors) is fast (target: under 2 s for capuchin)."""

import time

import pytest

from capuchin_tf.core import synthetic
from capuchin_tf.core.device_model import DeviceModel
from capuchin_tf.policy import make_plan


@pytest.fixture(scope="module")
def bert():
    return synthetic.bert_base()


@pytest.mark.parametrize("link", ["native", "p100"])
@pytest.mark.parametrize("fraction", [0.7, 0.4])
def test_capuchin_plans_bert_base_in_seconds(bert, link, fraction):
    dm = DeviceModel.from_link(link, bert)
    started = time.perf_counter()
    plan = make_plan(bert, synthetic.budget_fraction(bert, fraction), "capuchin", dm)
    elapsed = time.perf_counter() - started
    # generous for a loaded CI machine; `python -m capuchin_tf bench plan-speed` reports the real time
    assert elapsed < 10.0
    assert plan.decisions and plan.planning_s <= elapsed
