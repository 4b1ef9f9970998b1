"""SGLang behaviour changes as HookRegistry hooks (installed as `mfd_sglang.patches`). Each module names
the SGLang internal it wraps, the SGLang version it was written for, and why."""
