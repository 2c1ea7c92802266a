"""rollwise-echo: an example environment plugin (see README.md)."""
