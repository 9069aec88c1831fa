"""Performance model: FLOP and memory arithmetic (the planner builds on it)."""
