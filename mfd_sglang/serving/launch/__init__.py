"""What runs once, when a server launches (nothing here runs in a round):

- ``algorithms``: the two speculative algorithms (spec class, ``is_mfd``, registration through SGLang's plugin
  registry, called by ``mfd_sglang.plugin.register`` with the worker factory);
- ``resolve``: server-argument resolution and the launch-time refusals (each names its fix);
- ``options``: the plugin options that SGLang has no flag for (``--mfd-*`` flags, environment variables);
- ``target_checks``: targets and verify paths on which a tree verify would be silently wrong, refused;
- ``memory``: the device memory MFD adds outside SGLang's plan, reserved at launch.
"""
