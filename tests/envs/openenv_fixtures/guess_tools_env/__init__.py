"""guess_tools_env: an OpenEnv MCP test environment (see ../README.md)."""
