"""What capuchin_tf quotes of an error (runtime/errors.py `oom_line`): the out-of-memory line, else what went wrong,
never only the frame TensorFlow puts around a graph error."""

from capuchin_tf.runtime.errors import oom_line

# TensorFlow 2.21's graph errors, as the measured step met them (a Const kernel whose tensor could not be allocated
# under the budget: AdamW with EMA and gradient accumulation through model.fit), and as they look with stacks.
WITHOUT_STACKS = """Graph execution error:

Detected at node adam_w/cond/zeros defined at (most recent call last):
<stack traces unavailable>
Cannot parse tensor from proto: goo.gle/debugstr
dtype: DT_FLOAT
tensor_shape {
  dim {
    size: 512
  }
}

\t [[{{node adam_w/cond/zeros}}]] [Op:capuchin_passive_step_0]"""

WITH_STACKS = """Graph execution error:

Detected at node 'foo/bar' defined at (most recent call last):
  File "/x.py", line 3, in <module>

  File "/y.py", line 9, in f
    return g()

Incompatible shapes: [2] vs. [3]
\t [[{{node foo/bar}}]] [Op:__inference_f_12]"""

OOM = """Graph execution error:

Detected at node a defined at (most recent call last):
<stack traces unavailable>
OOM when allocating tensor with shape[1024,1024] and type float on /job:localhost/replica:0/task:0/device:CPU:0
\t [[{{node a}}]]
Hint: If you want to see a list of allocated tensors when OOM happens, add report_tensor_allocations_upon_oom"""


def test_a_graph_error_is_quoted_by_what_it_says_and_its_node():
    assert oom_line(Exception(WITHOUT_STACKS)) == ("Cannot parse tensor from proto: goo.gle/debugstr "
                                                   "(node adam_w/cond/zeros)")
    assert oom_line(Exception(WITH_STACKS)) == "Incompatible shapes: [2] vs. [3] (node foo/bar)"


def test_the_out_of_memory_line_comes_first_and_other_errors_by_their_first_line():
    assert oom_line(Exception(OOM)).startswith("OOM when allocating tensor with shape[1024,1024]")
    assert oom_line(Exception("plain message\nmore")) == "plain message"
    assert oom_line(Exception("")) == ""
    assert len(oom_line(Exception("x" * 1000))) == 300
