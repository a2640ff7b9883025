    ### BEGIN SOLUTION
    # Wrong: the reference pipeline with a synchronize between stages: the host waits for the GPU every batch.
    dev = torch.get_device_module(device)
    copy_stream, compute_stream = dev.Stream(), dev.current_stream()
    bufs = [None, None]
    copied = [dev.Event(), dev.Event()]
    used = [dev.Event(), dev.Event()]

    def start_copy(i, batch):
        k = i % 2
        if bufs[k] is None:
            bufs[k] = torch.empty_like(batch, device=device)
        with dev.stream(copy_stream):
            copy_stream.wait_event(used[k])
            bufs[k].copy_(batch, non_blocking=True)
        copied[k].record(copy_stream)

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
        dev.synchronize()                      # "to be safe"
        compute_stream.wait_event(copied[i % 2])
        yield bufs[i % 2]
        used[i % 2].record(compute_stream)
        if nxt is None:
            return
        i += 1
    ### END SOLUTION
