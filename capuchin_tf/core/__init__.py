"""The pure core: what a training step is and what to do with it, as plain data. Imports no TensorFlow.

graph_model (ops, tensors, roles), trace (the measured access trace and its JSON format), trace_assembly (a trace
from kernel and memory events), trace_index (lookups the planners need), plan (decisions and their JSON format),
device_model (link and compute rates), schedule (execution orders), pool_plan (which tensors the pool holds),
budget (budget arithmetic and syntax), control_flow (control-flow op facts), synthetic (generated traces for tests).
"""
