"""tierlm: decoder-only LLMs across memory tiers, compiled when placement allows."""
