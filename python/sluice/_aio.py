"""Settles asyncio futures from the binding's runtime threads (through call_soon_threadsafe)."""


def resolve(future, ok, value):
    if future.done():  # cancelled meanwhile
        return
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)
