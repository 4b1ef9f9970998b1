"""``sgl_kernel.kvcacheio`` stand-in: the HiCache host-memory KV transfers, imported by
``mem_cache/memory_pool_host.py`` and ``mem_cache/pool_host/mha.py`` when they load on CUDA, called
only with ``--enable-hierarchical-cache`` (not used with this plugin)."""

from ._unavailable import unavailable

_USE = "HiCache host-memory KV transfer"

transfer_kv_all_layer = unavailable("kvcacheio.transfer_kv_all_layer", _USE)
transfer_kv_all_layer_direct_lf_pf = unavailable("kvcacheio.transfer_kv_all_layer_direct_lf_pf", _USE)
transfer_kv_all_layer_lf_pf = unavailable("kvcacheio.transfer_kv_all_layer_lf_pf", _USE)
transfer_kv_all_layer_lf_ph = unavailable("kvcacheio.transfer_kv_all_layer_lf_ph", _USE)
transfer_kv_all_layer_mla = unavailable("kvcacheio.transfer_kv_all_layer_mla", _USE)
transfer_kv_all_layer_mla_lf_pf = unavailable("kvcacheio.transfer_kv_all_layer_mla_lf_pf", _USE)
transfer_kv_direct = unavailable("kvcacheio.transfer_kv_direct", _USE)
transfer_kv_per_layer = unavailable("kvcacheio.transfer_kv_per_layer", _USE)
transfer_kv_per_layer_direct_pf_lf = unavailable("kvcacheio.transfer_kv_per_layer_direct_pf_lf", _USE)
transfer_kv_per_layer_mla = unavailable("kvcacheio.transfer_kv_per_layer_mla", _USE)
transfer_kv_per_layer_mla_pf_lf = unavailable("kvcacheio.transfer_kv_per_layer_mla_pf_lf", _USE)
transfer_kv_per_layer_pf_lf = unavailable("kvcacheio.transfer_kv_per_layer_pf_lf", _USE)
transfer_kv_per_layer_ph_lf = unavailable("kvcacheio.transfer_kv_per_layer_ph_lf", _USE)
