"""The command line (``python -m capuchin_tf``) and the benchmark models and zoo it runs."""
