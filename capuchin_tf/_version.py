"""The version of capuchin_tf (read by setup.py without importing the package)."""

__version__ = "0.1.0"
