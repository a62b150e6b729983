"""A decode connector whose READs a test holds in flight (fault injection), loaded by vLLM by module path.

While the file named by ``kv_connector_extra_config {"hold_reads_file": PATH}`` exists, every transfer's status
reads "in progress" and the first such check creates ``PATH.held``: the test then knows a pull's READ is posted and
not seen finished, kills the prefill instance, and lets the pull's deadline pass before removing PATH. A stalled
prefill cannot hold a READ in flight: over UCX's shared memory a one-sided READ completes without the target's
progress. Without the file the connector is ``NixlKvConnector`` as it is.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from nixl_kv.interfaces import TransferStatus
from nixl_kv.vllm.connector import NixlKvConnector


class HeldReadsConnector(NixlKvConnector):
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        path = self._vllm_config.kv_transfer_config.get_from_extra_config("hold_reads_file", None)
        if not path:
            return
        agent = self._worker.transceiver._agent
        real_status = agent.status

        def status(handle: Any) -> TransferStatus:
            if os.path.exists(path):
                Path(path + ".held").touch()
                return TransferStatus.IN_PROGRESS
            return real_status(handle)

        agent.status = status
