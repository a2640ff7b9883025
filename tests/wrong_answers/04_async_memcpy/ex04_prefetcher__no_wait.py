    ### BEGIN SOLUTION
    # Wrong: the caller's stream never waits for the copy, so compute may read a buffer still being filled.
    dev = torch.get_device_module(device)
    copy_stream, compute_stream = dev.Stream(), dev.current_stream()
    bufs = [None, None]
    used = [dev.Event(), dev.Event()]

    def start_copy(i, batch):
        k = i % 2
        if bufs[k] is None:
            bufs[k] = torch.empty_like(batch, device=device)
        with dev.stream(copy_stream):
            copy_stream.wait_event(used[k])
            bufs[k].copy_(batch, non_blocking=True)

    it = iter(batches)
    first = next(it, None)
    if first is None:
        return
    start_copy(0, first)
    i = 0
    while True:
        nxt = next(it, None)
        if nxt is not None:
            start_copy(i + 1, nxt)
        yield bufs[i % 2]
        used[i % 2].record(compute_stream)
        if nxt is None:
            return
        i += 1
    ### END SOLUTION
