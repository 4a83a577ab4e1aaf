"""capuchin_tf: Capuchin (Peng et al., ASPLOS 2020) for TensorFlow 2.x.

Cuts the device memory a training step needs by evicting tensors to host memory and prefetching them back in time,
or by recomputing them, deciding per tensor from the access pattern measured at runtime.

Importing this package loads TensorFlow and capuchin_tf's op library, which installs capuchin_tf's device allocator
wrapper; import it before running any TensorFlow op. See README.md and docs/.

With the environment variable CAPUCHIN_TF_PURE=1 only the pure-Python layers are importable (graph model, trace,
policy, simulator): nothing loads TensorFlow, so they can be used and tested on machines without it.
"""

import os as _os

from capuchin_tf._version import __version__

PURE = _os.environ.get("CAPUCHIN_TF_PURE") == "1"

if not PURE:
    from capuchin_tf._tf_api import *  # noqa: F401,F403  (loads TensorFlow and the op library)
    from capuchin_tf._tf_api import __all__ as _tf_all

    __all__ = ["__version__", *_tf_all]
else:
    __all__ = ["__version__"]
