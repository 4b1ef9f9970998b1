"""MFD and MFD_D inside a real SGLang 0.5.23 server.

- ``algorithms``: the two speculative algorithms (spec classes, launch-time checks, server-argument
  resolution) registered through SGLang's plugin registry by ``mfd_sglang.plugin.register``;
- ``options``: the plugin options that SGLang has no flag for (environment variables);
- ``target_checks``: targets and verify paths on which a tree verify would be silently wrong, refused;
- ``memory``: the device memory MFD adds outside SGLang's plan, reserved at launch;
- ``draft_context_pool``: the drafter's context keys/values, indexed by the target's KV slot ids;
- ``worker``: ``MFDWorkerV2``, the spec-V2 worker (prefill, then draft / tree / verify / commit);
- ``penalties``: penalties, min_new_tokens and logit_bias at every tree node, as the plain server applies them;
- ``commit``: the commit stage (accepted path's target KV and drafter context), shared with benchmarks;
- ``verify_graph``: the target's tree-verify CUDA graph runner.
"""
