"""guess_env: an OpenEnv test environment (see ../README.md)."""
