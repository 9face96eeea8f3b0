"""Expert memory: where a MoE layer's experts come from and what stays resident.

expert_source (the explicit source in the path: the mapping, the budgeted cache, remote
shards, telemetry as a wrapper over any), expert_cache (the memory budget), eviction /
prefetch (its policies), residency / telemetry (what is in RAM, measured), expert_shards /
shard_worker (experts on Ray actors).
"""
