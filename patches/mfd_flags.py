"""MFD's options as flags of SGLang's own argument parser (SGLang 0.5.23 has no plugin-argument API).

- AFTER ``sglang.srt.server_args.ServerArgs.add_cli_args(parser)``: adds the group "MFD speculative
  decoding" (`mfd_sglang.serving.launch.options.add_cli_args`), so ``python -m sglang.launch_server --help`` lists
  the flags and SGLang's ``--config`` YAML merger (which reads the parser's actions) accepts them. Every
  SGLang launcher loads plugins before it parses arguments.
- AFTER ``ServerArgs.from_cli_args(args)``, which keeps only ServerArgs fields: the flags given are stored on
  the record as ``mfd_options`` (a dict), which rides along to every scheduler process with the record, as
  SGLang's own ``_launch_command`` does; a flag given to a server that does not run MFD / MFD_D is refused
  there, naming it.
"""

from __future__ import annotations

ADD_CLI_ARGS = "sglang.srt.server_args.ServerArgs.add_cli_args"
FROM_CLI_ARGS = "sglang.srt.server_args.ServerArgs.from_cli_args"


def add_mfd_flags_after(result, parser, *args, **kwargs):
    from mfd_sglang.serving.launch.options import add_cli_args

    add_cli_args(parser)
    return result


def keep_mfd_flags_after(server_args, *args, **kwargs):
    from mfd_sglang.serving.launch.algorithms import is_mfd
    from mfd_sglang.serving.launch.options import OPTIONS, given_options

    namespace = args[-1] if args else kwargs["args"]
    given = given_options(namespace)
    if given and not is_mfd(server_args.speculative_algorithm):
        flags = ", ".join(o.flag for o in OPTIONS if o.field in given)
        raise ValueError(f"{flags}: MFD options, for --speculative-algorithm MFD or MFD_D only (this server runs "
                         f"{server_args.speculative_algorithm or 'no speculative decoding'}); drop them.")
    server_args.mfd_options = given
    return server_args


def install() -> None:
    from mfd_sglang.patches import register_once

    register_once(ADD_CLI_ARGS, add_mfd_flags_after, "after")
    register_once(FROM_CLI_ARGS, keep_mfd_flags_after, "after")
