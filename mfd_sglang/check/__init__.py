"""Checks of an installed plugin on a device, as rows with verdicts: one implementation, two front ends.

- `python -m mfd_sglang check --target T --drafter D` (`selfcheck`): the self-check a user runs on their own
  installed SGLang and sends back: every Triton kernel against its torch reference at the pair's shapes and
  budget, a CUDA-graph capture and replay of a verify window, plain / MFD / MFD_D servers on the pair, the
  versions and the GPU;
- `benchmarks/gpu_check.py` (`scripts/gpu_check.sh`): the project's own procedure for a borrowed GPU machine
  (parts 1, 2 and flashinfer, a carried kit and pair, one deadline).

Both run `Section`s through `run.run_sections`: a section is a function of the `Check` (device, deadline,
output folder) that yields rows as they finish. A correctness row carries `ok` (True / False) or `skipped`
(a structural reason: needs CUDA on a CPU run, FlashInfer where it is not installed, `--mfd-kernels torch`),
and `error` when it raised (`run.measured_row`); a measurement row carries numbers only. A section fails when
it was not run (the deadline), raised, checked nothing although it owes verdicts, or holds a failed or erred
row; a section that raises `run.StructuralSkip` passes. `report.json` (rewritten after every row) and
`rows.jsonl` (a line per row) go to the output folder as rows finish; the exit status is 0 only when nothing
failed.

The modules: `run` (the machinery: sections, rows, verdicts, report, summary), `environment` (versions, the
GPU, the plugin's registration in SGLang), `kernels` (each Triton kernel against its torch reference at given
shapes), `graphs` (a verify window captured as CUDA graphs per batch-size bucket against eager), `servers`
(real SGLang servers held to a plain server: tokens, accept lengths, round times), `selfcheck` (the user's
command). Nothing here loads a file of the repository by path: it runs from an installed wheel.
"""
