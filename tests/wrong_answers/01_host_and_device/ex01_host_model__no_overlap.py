    # Wrong: a read waits for all the GPU time queued since the last read, as if the host's own work had
    # not overlapped it.
    host = gpu = blocked = 0.0
    pending = 0.0
    for what, ms in program:
        if what == "gpu":
            gpu = max(gpu, host) + ms
            pending += ms
        elif what == "cpu":
            host += ms
        elif what == "read":
            blocked += pending
            host += pending
            pending = 0.0
    return host, gpu, blocked
