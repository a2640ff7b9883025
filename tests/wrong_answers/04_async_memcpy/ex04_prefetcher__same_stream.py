# ruff: noqa: F821  (torch and events come from the notebook)
# Wrong: reads ahead, but copies on the caller's own stream, so each copy waits for the compute before it.
def prefetch(batches, device, tl):
    it = iter(batches)
    nxt = next(it, None)
    i = 0
    cur = None
    if nxt is not None:
        with tl.span(f"h2d {i}", kind="h2d"):
            cur = nxt.to(device, non_blocking=True)
    while cur is not None:
        nxt = next(it, None)
        following = None
        if nxt is not None:
            with tl.span(f"h2d {i + 1}", kind="h2d"):
                following = nxt.to(device, non_blocking=True)
        yield cur
        cur = following
        i += 1
