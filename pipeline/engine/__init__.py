"""The embedded SGLang-compatible engine, a process of its own: `python -m pipeline.engine` (=
`rollwise engine serve`)."""
