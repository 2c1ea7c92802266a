"""The policy's model: loading and writing HF directories (model_io), the presets (model_init,
gguf_presets), LoRA adapters (lora), precision modes and frozen casts, and MoE routers (moe_routing).
Imports nothing else of learner/."""
