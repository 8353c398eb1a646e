"""The policy: transformers' ``GlmMoeDsaForCausalLM`` (GLM-5's architecture) with a tiny
config, patched by ``apply_glm_kernels`` (``policy.py``); its Hugging Face checkpoint
(``hf_checkpoint.py``)."""
