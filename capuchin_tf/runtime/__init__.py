"""The runtime: the managed step (measured, then guided execution, feedback, plan cache) and its recovery from
out-of-memory errors (variable snapshots, restores, compaction)."""
