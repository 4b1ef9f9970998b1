"""SGLang plugin entry point (`sglang.srt.plugins` group, see setup.py).

SGLang calls `register()` once per process (launcher, scheduler, detokenizer). The MFD / MFD_D
algorithms, the draft model class and the CPU attention backend are registered here by the SGLang
integration; until that lands, loading the plugin only confirms that the package imports, so a
broken install shows up as an import error in SGLang's plugin log rather than as
"Unknown speculative algorithm" later.
"""

import logging

logger = logging.getLogger(__name__)


def register() -> None:
    from . import __version__

    logger.debug("mfd_sglang %s plugin loaded (no algorithms registered in this version)", __version__)
