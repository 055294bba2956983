"""The alignment tiers, one module each (tier 0 ops, tier 1 layers, tier 2 model, training and vision,
tier 3 processes, tier 4 on paper), with tier 0's inputs and tier 2's pinned expert choices."""
