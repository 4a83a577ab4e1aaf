"""The TensorFlow layer: the only code that touches TensorFlow's private API.

loader (finds and loads the op library), ops (Python wrappers of the custom ops), capture (a ConcreteFunction to a
graph model), rewrite (a plan into a guided graph and a callable function), measure (the measured step and its
trace), simulated_device (the environment of the simulated device). Imports the core; nothing above it.
"""
