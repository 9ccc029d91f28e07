"""PyTorch's own dynamic-group RPC tests (``init_rpc`` without ``world_size``), which it runs for its
TensorPipe backend only (they are methods of ``TensorPipeAgentRpcTest``), run unchanged against
the SLUICE backend, but the CUDA one: a dynamic SLUICE group carries CPU tensors only, and refuses
device maps.

    python -m pytest -q test_dynamic.py
"""

from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed.rpc.rpc_agent_test_fixture import RpcAgentTestFixture
from torch.testing._internal.distributed.rpc.rpc_test import TensorPipeAgentRpcTest
from torch.testing._internal.distributed.rpc_utils import generate_tests

from sluice_fixture import SluiceRpcAgentTestFixture

# The CUDA one sets device maps, which a dynamic SLUICE group refuses (CPU tensors only).
DYNAMIC = [n for n in dir(TensorPipeAgentRpcTest) if n.startswith("test_dynamic_") and not n.endswith("_cuda")]


class DynamicGroupTest(RpcAgentTestFixture):
    """The dynamic-group tests of PyTorch's TensorPipe suite, borrowed as they are."""


for _name in DYNAMIC:
    setattr(DynamicGroupTest, _name, getattr(TensorPipeAgentRpcTest, _name))

globals().update(generate_tests("Sluice", SluiceRpcAgentTestFixture, [DynamicGroupTest], __name__))

if __name__ == "__main__":
    run_tests()
