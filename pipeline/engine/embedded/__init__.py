"""rollwise's embedded SGLang-compatible inference engine (aiohttp server + torch continuous batcher).

`server.main(argv)` is `rollwise engine serve`; `batcher.ContinuousBatcher` owns the model; `sampling`
holds the pure sampling maths; `metrics` the engine's own Prometheus registry (SGLang metric names).
"""
