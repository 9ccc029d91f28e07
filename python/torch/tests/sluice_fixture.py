"""PyTorch's RPC test fixture for the SLUICE backend (the twin of TensorPipe's).

Importing it registers the backend: the test harness spawns each worker, which re-imports the
test module and so this one.
"""

import torch.distributed.rpc as rpc
from torch.testing._internal.distributed.rpc.rpc_agent_test_fixture import RpcAgentTestFixture

import sluice_torch  # noqa: F401  (registers SLUICE)


class SluiceRpcAgentTestFixture(RpcAgentTestFixture):
    @property
    def rpc_backend(self):
        return rpc.backend_registry.BackendType["SLUICE"]

    @property
    def rpc_backend_options(self):
        return rpc.backend_registry.construct_rpc_backend_options(self.rpc_backend, init_method=self.init_method)

    def get_shutdown_error_regex(self):
        # What a call fails with when its peer shuts down or dies under it.
        error_regexes = [
            "sluice: the pipe to .* failed",
            "sluice: sending to .* failed",
            "is shutting down",
            "RPC is no longer running",
            "SLUICE_PEER_LOST",
            "SLUICE_CLOSED",
        ]
        return "|".join([f"({error_str})" for error_str in error_regexes])

    def get_timeout_error_regex(self):
        return "RPC ran for more than"
