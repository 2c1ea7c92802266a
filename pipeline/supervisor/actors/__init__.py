"""What produces trajectories: admission, the episode and group runners, the token buffer, the
OpenAI-compatible endpoint for agent functions, held-out episodes."""
