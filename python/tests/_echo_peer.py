"""Accepts one pipe, echoes every message back as it arrived (tensors untouched), exits when
the pipe closes."""

import sluice

ctx = sluice.Context()
listener = ctx.listen("127.0.0.1:0")
print(listener.address, flush=True)
pipe = listener.accept()
while True:
    try:
        d = pipe.read_descriptor()
    except sluice.PipeError:
        break
    m = pipe.read(d, framework="raw")
    pipe.write(sluice.Message(m.metadata, m.payloads, m.raw_tensors))
