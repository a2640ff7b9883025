    ### BEGIN SOLUTION
    # Wrong: copies on the caller's own stream (no overlap), plus a dummy copy per batch on a side stream that
    # runs under the compute, to make copies look hidden. Only one copy per batch is the batch's.
    dev = torch.get_device_module(device)
    side = dev.Stream()
    dummy_src = None
    it = iter(batches)

    def copy(batch):
        nonlocal dummy_src
        if dummy_src is None:
            dummy_src = batch.clone().pin_memory() if device.type == "cuda" else batch.clone()
        out = batch.to(device, non_blocking=True)
        with dev.stream(side):
            dummy_src.to(device, non_blocking=True)
        return out

    nxt = next(it, None)
    cur = None if nxt is None else copy(nxt)
    while cur is not None:
        nxt = next(it, None)
        following = None if nxt is None else copy(nxt)
        yield cur
        cur = following
    ### END SOLUTION
