"""One decision of which implementation runs the round (`mfd_sglang.backend`, --mfd-kernels):

- `resolve_backend`: auto is Triton on CUDA and torch elsewhere, torch is torch everywhere, triton without CUDA
  is refused naming the flag (allowed under the Triton interpreter), an unknown choice is refused;
- the decision, not the device, picks every step: on one device (CPU tensors under the Triton interpreter, in a
  subprocess) the serving stages with backend "torch" launch no Triton kernel at all (draft with FP8 linears,
  tree, layout, verify mask, accept, commit), with backend "triton" each stage launches its kernels, and both
  give the same tree, layout, mask, accepted path and drafter context.

The launch refusal through SGLang's own argument resolution is a case of tests/test_mfd_server.py's bad
launches; a server running --mfd-kernels torch is tests/test_readme_launch.py's.
"""

import collections
from types import SimpleNamespace

import pytest
import torch

from interpreted import main, run_cases
from mfd_sglang.backend import resolve_backend
from references import HIDDEN, N_CTX, VOCAB, make_drafter


@pytest.mark.parametrize("choice, device, expected", [("auto", "cuda", "triton"), ("auto", "cuda:1", "triton"),
                                                       ("auto", "cpu", "torch"), ("torch", "cuda", "torch"),
                                                       ("torch", "cpu", "torch"), ("triton", "cuda:0", "triton")])
def test_resolve_backend(choice, device, expected, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert resolve_backend(choice, device) == expected


def test_triton_without_cuda_and_unknown_choices_are_refused_naming_the_flag(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="--mfd-kernels triton runs MFD's Triton kernels, which need a CUDA device "
                                         r"\(this server runs on cpu\); pass --mfd-kernels auto or torch"):
        resolve_backend("triton", "cpu")
    with pytest.raises(ValueError, match="--mfd-kernels 'cuda': pass one of auto, torch, triton"):
        resolve_backend("cuda", "cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the kernels run on CPU tensors under the interpreter
    assert resolve_backend("triton", "cpu") == "triton"


def round_on(backend: str) -> tuple[dict, collections.Counter]:
    """One decode round's own stages through the serving code on CPU tensors (bs 3, B 12, an FP8 drafter),
    every stage on `backend`: (their outputs, the Triton launches per stage)."""
    import triton.runtime.interpreter as interpreter

    from mfd_sglang.serving.accept import accept_tree
    from mfd_sglang.serving.budget.rule import Arm
    from mfd_sglang.serving.commit import commit_round
    from mfd_sglang.serving.draft_stage import DraftStage
    from mfd_sglang.serving.verify import layout_verify_input

    launches, stage_name = collections.Counter(), ["setup"]
    run = interpreter.InterpretedFunction.run

    def counted(self, *args, **kwargs):
        launches[stage_name[0]] += 1
        return run(self, *args, **kwargs)

    interpreter.InterpretedFunction.run = counted
    try:
        gen = torch.Generator().manual_seed(0)
        drafter = make_drafter(num_modes=3, seed=5).quantize_linears_fp8()
        embed = torch.randn(VOCAB, HIDDEN, generator=gen)
        stage = DraftStage(drafter, embed, torch.randn(VOCAB, HIDDEN, generator=gen), backend=backend)
        bs, budget, max_len, num_slots = 3, 12, 40, 3 * 40
        table = torch.arange(num_slots, dtype=torch.int32).view(bs, max_len)
        stage.init_context_pool(num_slots, SimpleNamespace(req_to_token=table), device="cpu", dtype=torch.float32)
        seq_lens = torch.tensor([5, 17, 9])
        positions = torch.arange(max_len).repeat(bs)
        stage.write_context(torch.randn(num_slots, N_CTX * HIDDEN, generator=gen), positions,
                            torch.arange(num_slots))
        roots = torch.tensor([3, 11, 7])
        stage_name[0] = "draft + tree + layout"
        tree, layout = stage.tree(roots, seq_lens, torch.arange(bs), max_len, Arm(False, budget))
        stage_name[0] = "verify mask"
        mask = layout_verify_input(layout, seq_lens, int(seq_lens.sum()), drafter.num_draft_positions,
                                   backend).custom_mask
        stage_name[0] = "accept"
        # The target agrees with the drafter's best path for two tokens, then with nothing.
        logits = torch.full((bs, budget + 1, VOCAB), -5.0)
        first = (tree.depths == 1).float().argmax(dim=1)
        logits[torch.arange(bs), 0, tree.tokens[torch.arange(bs), first]] = 5.0
        logits[:, 1:, 0] = 5.0
        batch = SimpleNamespace(sampling_info=SimpleNamespace(is_all_greedy=True, logit_bias=None,
                                                              penalizer_orchestrator=None))
        result, _ = accept_tree(tree, layout, logits.view(bs * (budget + 1), VOCAB), batch, seq_lens,
                                backend=backend)
        stage_name[0] = "commit"
        slots = table.gather(1, seq_lens[:, None] + torch.arange(budget + 1)).long()  # the verify windows
        commit_round(result, torch.randn(bs, budget + 1, N_CTX * HIDDEN, generator=gen), seq_lens, slots,
                     stage.context_pool, stage.drafter, lambda path: None)
    finally:
        interpreter.InterpretedFunction.run = run
    outputs = {"tokens": tree.tokens, "parents": tree.parents, "next_token": layout.retrive_next_token,
               "ancestor_mask": layout.ancestor_mask, "mask": mask, "accepted": result.accepted_local_indices,
               "accept_lens": result.accept_lens, "pool_keys": stage.context_pool.keys[0]}
    return outputs, launches


def case_the_decision_picks_every_step():
    torch_outputs, torch_launches = round_on("torch")
    assert not torch_launches, f"backend torch launched Triton kernels: {dict(torch_launches)}"
    triton_outputs, triton_launches = round_on("triton")
    for stage in ("draft + tree + layout", "verify mask", "accept", "commit"):
        assert triton_launches[stage] > 0, f"backend triton launched nothing in {stage}: {dict(triton_launches)}"
    assert (torch_outputs["accept_lens"] >= 2).all(), torch_outputs["accept_lens"]  # a drafted token each
    for name, want in torch_outputs.items():
        have = triton_outputs[name]
        if want.is_floating_point():
            torch.testing.assert_close(have, want, atol=2e-4, rtol=2e-4, msg=name)
        else:
            assert torch.equal(have, want), name


CASES = {fn.__name__: fn for fn in (case_the_decision_picks_every_step,)}


def test_the_decision_not_the_device_picks_every_step():
    run_cases(__file__, CASES)


if __name__ == "__main__":
    main(CASES)
