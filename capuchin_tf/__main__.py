"""``python -m capuchin_tf``: the command line (capuchin_tf.cli)."""

from capuchin_tf.cli import main

import capuchin_tf.profile_cli  # noqa: E402,F401  (registers `profile`)

raise SystemExit(main())
