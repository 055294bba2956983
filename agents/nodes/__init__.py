"""The graph's nodes, each a small function over the state calling onboard/ tools."""
