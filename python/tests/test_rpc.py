"""RPC shaped like torch.distributed.rpc, across real processes with torchrun's variables."""

import os
import tempfile


def test_rpc_sync_with_tensors_of_every_kind(group):
    group("calls")


def test_futures_then_callbacks_asyncio_and_async_execution(group):
    group("futures")


def test_remote_rrefs_proxies_and_a_parameter_server(group):
    group("rrefs", world=3)


def test_errors_arrive_typed_and_the_agent_keeps_serving(group):
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "only_here.py"), "w") as f:
            f.write("def hello():\n    return 'hello'\n")
        group("errors", extra_path=d)


def test_the_gil_is_released_during_calls(group):
    group("gil")


def test_options_device_maps_timeouts_and_transports(group):
    group("options")


def test_remote_tensors_run_on_their_owners(group):
    group("remote_tensors", world=3)


def test_training_on_remote_parameters(group):
    group("remote_training")


def test_call_priorities_from_python(group):
    group("priorities")


def test_functions_travel_by_reference_or_pickled(group):
    group("references")
