"""Adapters for the environment ecosystems users already have (docs/design/env_ecosystems.md)."""
