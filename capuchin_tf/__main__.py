"""``python -m capuchin_tf``: the command line (capuchin_tf.cli.main)."""

from capuchin_tf.cli.main import main

raise SystemExit(main())
