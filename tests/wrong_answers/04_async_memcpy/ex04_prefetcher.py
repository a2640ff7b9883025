    ### BEGIN SOLUTION
    # Wrong: one device buffer instead of two. The next batch's copy lands in the buffer the caller is
    # about to read, so batch i is replaced by batch i+1 (wrong data on a CPU too).
    dev = torch.get_device_module(device)
    copy_stream, compute_stream = dev.Stream(), dev.current_stream()
    buf = None
    copied, used = dev.Event(), dev.Event()

    def start_copy(batch):
        nonlocal buf
        if buf is None:
            buf = torch.empty_like(batch, device=device)
        with dev.stream(copy_stream):
            copy_stream.wait_event(used)
            buf.copy_(batch, non_blocking=True)
        copied.record(copy_stream)

    it = iter(batches)
    first = next(it, None)
    if first is None:
        return
    start_copy(first)
    while True:
        nxt = next(it, None)
        if nxt is not None:
            start_copy(nxt)
        compute_stream.wait_event(copied)
        yield buf
        used.record(compute_stream)
        if nxt is None:
            return
    ### END SOLUTION
