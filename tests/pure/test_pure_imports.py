"""The pure layers (policy maker, simulator, plans, budgets, plan cache, schedules, feedback) import no TensorFlow or Keras,
directly or indirectly."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_modules_import_with_tensorflow_blocked():
    code = (
        "import sys; sys.modules['tensorflow'] = None; sys.modules['keras'] = None\n"
        "import capuchin_tf.policy, capuchin_tf.simulator, capuchin_tf.plan, capuchin_tf.device_model\n"
        "import capuchin_tf.synthetic, capuchin_tf.cli, capuchin_tf.trace_index\n"
        "import capuchin_tf.budget, capuchin_tf.plan_cache, capuchin_tf.passive, capuchin_tf.schedule\n"
        "import capuchin_tf.feedback\n"
        "from capuchin_tf.policy import make_plan\n"
        "from capuchin_tf import synthetic\n"
        "t = synthetic.linear_chain(3)\n"
        "p = make_plan(t, synthetic.budget_fraction(t, 0.5), 'capuchin')\n"
        "assert not {'tensorflow', 'keras'} & {m.split('.')[0] for m in sys.modules if sys.modules[m] is not None}\n"
        "print('ok', p.feasible)\n"
    )
    env = dict(os.environ, CAPUCHIN_TF_PURE="1")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ok")
