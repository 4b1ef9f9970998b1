"""MFD and MFD_D inside a real SGLang 0.5.23 server. The round's stages are this folder's modules, in the order
the worker (``worker``: ``MFDWorkerV2``, SGLang's spec-V2 worker) calls them:

- ``draft_stage``: draft + tree + verify layout of an arm (the drafter, its context pool and graphs);
  ``draft_context_pool``: the drafter's context keys/values, indexed by the target's KV slot ids;
- ``verify``: SGLang's tree-verify input and the target's verify forward; ``verify_graph``: its CUDA graph
  runner (and one per window width);
- ``accept``: the accepted path and the prefill's first token, by the plain server's law (``penalties``:
  penalties, min_new_tokens and logit_bias at every tree node, as the plain server applies them);
- ``outputs``: logprobs and sampling masks of the emitted tokens (``sampling_mask``: the law's support);
- ``commit``: the accepted path's target KV and drafter context (shared with the round-cost harness).

Apart from the round:
- ``launch/``: what runs once, at launch (algorithms, argument resolution, plugin options, target checks,
  the memory plan);
- ``budget/``: the budget a round drafts at (the automatic budget's rule, its worker side and start-up
  calibration; the default per-batch-size schedule on CUDA).
"""
