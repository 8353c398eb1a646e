"""Thin adapters for training/inference frameworks. Import the submodule you need:

* ``glm_kernels.integrations.slime``  -- loss / TIS / OPD-advantage plug-ins for slime's
  ``--custom-*-path`` flags.
* ``glm_kernels.integrations.slime_policy`` -- slime's policy loss with every option slime
  ships (GSPO, CISPO, dual clip, OPSM, TIS / IcePop / MIS, KL loss, entropy) on
  ``glm_kernels.policy_loss``, and mis.py's TIS hook, for ``--custom-loss-function-path`` /
  ``--custom-tis-function-path``.
* ``glm_kernels.integrations.slime_delta`` -- ``install`` for ``--custom-megatron-init-path``:
  slime's ``--update-weight-mode delta`` diffs on the GPU (only changed bytes leave it).
* ``glm_kernels.integrations.sglang`` -- an SGLang custom weight loader that applies delta
  packets in place on the engine's parameters.
* ``glm_kernels.integrations.verl`` -- registers in verl's policy-loss registry the
  ``"icepop"`` loss and ``"glm_<name>"`` beside every verl loss (``verl_losses``), also
  through the ``verl.plugins`` entry point.
* ``glm_kernels.integrations.megatron`` -- ``register()`` adds ``"muon_split"`` (MuonSplit,
  per head for ``linear_qkv`` and the MLA up-projections) to Megatron-core's emerging-optimizer
  registry, built by ``get_megatron_optimizer``.
* ``glm_kernels.integrations.trl`` -- ``IcePopGRPOTrainer`` / ``IcePopGRPOConfig``, a TRL
  ``GRPOTrainer`` whose loss is ``fused_linear_icepop_loss`` (coupled / TITO or decoupled).
* ``glm_kernels.integrations.transformers`` -- ``apply_glm_kernels(model)`` for GLM-5,
  GLM-4.5, DeepSeek-V3/V4 and Qwen3-MoE (routers through ``moe_route``, the DSA indexer
  through ``topk``), R3 (``record_routing`` / ``replay_routing``) and ``token_logprobs``.

Importing this package imports none of slime, Megatron, SGLang, verl, TRL or transformers.
"""
