"""A fake SGLang 0.5.23 server for tests, benchmarks and plugin authors without a GPU: the native HTTP
API as the real server answers it, refusals and crashes included, each rule citing SGLang's source
(sglang_rules.py); scriptable generations and a GPU-like latency model (generation_plans.py)."""

from pipeline.tools.fake_sglang.fake_server import FAULTS, FakeSGLang, RecordedRequest, free_port
from pipeline.tools.fake_sglang.generation_plans import (
    GenerateCall,
    LatencyModel,
    Plan,
    default_plan,
    lognormal_script,
    prompt_logprobs,
)

__all__ = [
    "FAULTS",
    "FakeSGLang",
    "GenerateCall",
    "LatencyModel",
    "Plan",
    "RecordedRequest",
    "default_plan",
    "free_port",
    "lognormal_script",
    "prompt_logprobs",
]
