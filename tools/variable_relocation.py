"""Does a training step move the model's large variables in device memory? (a fragmentation probe, docs/results.md)

Prints, for every variable of at least --min-mib MiB, whether its device buffer moved across (1) a restore from a
host copy (what capuchin_tf does after an out-of-memory error) and (2) each of --steps plain TensorFlow steps, with
the device memory in use after each. A variable whose buffer is replaced (an assignment that adopts a new buffer,
or a copy on write) lands wherever free memory was at that moment, and the free memory left for the next step can
come in more pieces.

    python tools/variable_relocation.py --model transformer --batch 32 --steps 2

Runs itself in a fresh process on the simulated device (`--device-mb`, default 400).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

MiB = 1 << 20


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--min-mib", type=float, default=1.0)
    p.add_argument("--device-mb", type=int, default=400)
    a = p.parse_args()
    if a.steps < 1 or a.batch < 1 or a.device_mb < 1:
        p.error("--steps, --batch and --device-mb must be positive")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's capuchin_tf
    if os.environ.get("CAPUCHIN_TF_RELOCATION_CHILD") != "1":
        from capuchin_tf.simulated_device import simulated_device_env

        env = simulated_device_env(a.device_mb)
        env["CAPUCHIN_TF_RELOCATION_CHILD"] = "1"
        return subprocess.call([sys.executable, *sys.argv], env=env)

    import numpy as np
    import tensorflow as tf

    import capuchin_tf
    from capuchin_tf import models, runtime

    setup = models.build(a.model, a.batch)
    big = [v for v in setup.variables if int(np.prod(v.shape)) * v.dtype.size >= a.min_mib * MiB]
    if not big:
        print(f"no variable of {a.model} has {a.min_mib} MiB or more")
        return 0

    def addresses() -> list[int]:
        out = []
        for v in big:
            view = v.value().numpy()  # a CPU read aliases the variable's buffer: its address is the buffer's
            out.append(view.ctypes.data)
            del view  # a live view would make the next update copy the buffer (copy on write)
        return out

    def in_use() -> float:
        return tf.config.experimental.get_memory_info("CPU:0")["current"] / MiB

    print(f"{a.model} b{a.batch}: {len(big)} variables of {a.min_mib} MiB or more; {in_use():.2f} MiB in use")
    before = addresses()
    step = capuchin_tf.function(setup.train_step)
    state = runtime.SignatureState(concrete=None, written=list(big))
    step._restore(state, [np.array(v.numpy(), copy=True) for v in big])
    after = addresses()
    moved = [v.name for v, x, y in zip(big, before, after) if x != y]
    print(f"restore from a host copy: moved {moved or 'nothing'}; {in_use():.2f} MiB in use")
    for i in range(a.steps):
        before = after
        setup.train_step(*setup.inputs)
        after = addresses()
        moved = [v.name for v, x, y in zip(big, before, after) if x != y]
        print(f"plain step {i + 1}: moved {moved or 'nothing'}; {in_use():.2f} MiB in use")
    return 0


if __name__ == "__main__":
    sys.exit(main())
