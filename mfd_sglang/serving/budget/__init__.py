"""The budget a round drafts at, when it is not one fixed number:

- ``schedule``: the default on CUDA, a budget per batch size from the round's cost model;
- ``rule``: the automatic budget's rule (--mfd-auto-budget: arms, acceptance and cost per arm, the choice);
- ``auto``: what the worker talks to (the chooser, round clock, acceptance on its way to the host, verify graphs
  per window); ``calibration``: its start-up cost measurement on placeholder requests.
"""
