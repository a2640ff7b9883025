    # Wrong: each kernel starts the moment it is launched, as if the GPU had no queue.
    host = gpu = blocked = 0.0
    for what, ms in program:
        if what == "gpu":
            gpu = max(gpu, host + ms)
        elif what == "cpu":
            host += ms
        elif what == "read":
            wait = max(0.0, gpu - host)
            blocked += wait
            host += wait
    return host, gpu, blocked
