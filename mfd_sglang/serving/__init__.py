"""MFD and MFD_D inside a real SGLang 0.5.23 server, one job per module.

Registration and launch:
- ``algorithms``: the two speculative algorithms (spec class, ``is_mfd``, registration through SGLang's
  plugin registry, called by ``mfd_sglang.plugin.register`` with the worker factory);
- ``launch``: server-argument resolution and the launch-time refusals (each names its fix);
- ``options``: the plugin options that SGLang has no flag for (environment variables);
- ``target_checks``: targets and verify paths on which a tree verify would be silently wrong, refused;
- ``memory``: the device memory MFD adds outside SGLang's plan, reserved at launch.

The round (``worker``: ``MFDWorkerV2``, SGLang's spec-V2 worker, calls the stages in order):
- ``draft_stage``: the drafter, its context pool and graphs: draft + tree + verify layout of an arm;
- ``draft_context_pool``: the drafter's context keys/values, indexed by the target's KV slot ids;
- ``tree_verify``: SGLang's tree-verify input and the target's verify forward;
- ``verify_graph``: the target's tree-verify CUDA graph runner (and one per window width);
- ``accept``: the accepted path and the prefill's first token, by the plain server's law;
- ``penalties``: penalties, min_new_tokens and logit_bias at every tree node, as the plain server applies them;
- ``commit``: the commit stage (accepted path's target KV and drafter context), shared with benchmarks;
- ``outputs``: logprobs and sampling masks of the emitted tokens (``sampling_mask``: the law's support).

The automatic budget (--mfd-auto-budget):
- ``budget``: the rule (arms, acceptance and cost per arm, the choice);
- ``auto_budget``: what the worker talks to (the chooser, round clock, acceptance on its way to the host,
  verify graphs per window, start-up ``calibration``).
"""
