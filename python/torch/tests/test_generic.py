"""PyTorch's own generic RPC suites (GENERIC_TESTS: RpcTest, DistAutogradTest, JitRpcTest, ...)
run against the SLUICE backend. Tests listed in skips.txt are skipped with their reason.

    python -m pytest -q test_generic.py -k "SluiceRpcTest and test_self_add"
"""

from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed.rpc_utils import GENERIC_TESTS, generate_tests

from sluice_fixture import SluiceRpcAgentTestFixture

globals().update(generate_tests("Sluice", SluiceRpcAgentTestFixture, GENERIC_TESTS, __name__))

if __name__ == "__main__":
    run_tests()
