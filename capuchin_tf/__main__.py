"""``python -m capuchin_tf``: the command line (capuchin_tf.cli)."""

from capuchin_tf.cli import main

raise SystemExit(main())
