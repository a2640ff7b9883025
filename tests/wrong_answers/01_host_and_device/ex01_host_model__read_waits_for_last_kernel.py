    # Wrong: a read waits only for the last kernel launched, counted from its launch.
    host = gpu = blocked = 0.0
    last_done = 0.0
    for what, ms in program:
        if what == "gpu":
            gpu = max(gpu, host) + ms
            last_done = host + ms
        elif what == "cpu":
            host += ms
        elif what == "read":
            wait = max(0.0, last_done - host)
            blocked += wait
            host += wait
    return host, gpu, blocked
