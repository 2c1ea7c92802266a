"""The agent API server: OpenAI Chat Completions, Responses and Anthropic Messages on the run's engines."""
