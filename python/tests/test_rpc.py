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


def test_plain_values_are_told_apart():
    """The binding's `_plain`: what the caller may pickle without the lifting pickler."""
    from sluice import rpc

    class Int(int):
        pass

    plain = [None, 1, 1.5, 2j, "s", b"b", True, (), [], {}, (1, "a"), [1, [2, [3]]],
             {"k": (1, 2)}, {None: 1, 2j: [b"x"]}, tuple(range(16)), {str(i): i for i in range(16)}]
    not_plain = [tuple(range(17)), list(range(17)), {str(i): i for i in range(17)}, [[[[1]]]],
                 {(1,): 1}, object(), rpc, Int(1), (Int(1),), {"k": object()}, [1, object()],
                 {1, 2}, bytearray(b"x"), range(3)]
    for v in plain:
        assert rpc._plain(v) is True, v
    for v in not_plain:
        assert rpc._plain(v) is False, v
