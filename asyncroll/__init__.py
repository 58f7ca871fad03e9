"""asyncroll: async-first rollout layer for RL with LLMs."""
