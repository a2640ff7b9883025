    ### BEGIN SOLUTION
    # Wrong: reads ahead, but copies on the caller's own stream, so each copy waits for the compute before it.
    it = iter(batches)
    nxt = next(it, None)
    cur = None if nxt is None else nxt.to(device, non_blocking=True)
    while cur is not None:
        nxt = next(it, None)
        following = None if nxt is None else nxt.to(device, non_blocking=True)
        yield cur
        cur = following
    ### END SOLUTION
