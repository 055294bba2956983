"""The parallel plan: dp_shard x ep meshes, activation policies and micro-batches searched for a cluster,
each costed per rank; plan.yaml and the terminal table."""
