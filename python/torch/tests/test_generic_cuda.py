"""PyTorch's CUDA RPC suites (GENERIC_CUDA_TESTS: CudaRpcTest, CudaDistAutogradTest, ...; and
TensorPipe's own CUDA suites, which test device maps through the options' generic API) run
against the SLUICE backend. Every test needs a GPU (most two): on a machine without one, each
skips. Run on the GPU machine by scripts/gpu-check.sh, through `run_generic.py cuda`.
"""

from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed.rpc_utils import GENERIC_CUDA_TESTS, TENSORPIPE_CUDA_TESTS, generate_tests

from sluice_fixture import SluiceRpcAgentTestFixture

globals().update(
    generate_tests("Sluice", SluiceRpcAgentTestFixture, GENERIC_CUDA_TESTS + TENSORPIPE_CUDA_TESTS, __name__)
)

if __name__ == "__main__":
    run_tests()
