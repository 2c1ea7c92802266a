"""What produces trajectories: admission, the episode and group runners (rollout.py and its parts), the
token buffer, held-out episodes; the agent API server for agent functions in agent_api/."""
