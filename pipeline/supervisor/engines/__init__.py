"""The supervisor's side of Contract 2: SGLang's HTTP protocol, one client per engine, the pool over
them, the router, LoRA adapters, weight syncs and the served-policy check."""
