    # WRONG (a bucket that reaches the cap exactly stays open)
    schedule, n, size, free = [], 0, 0, 0.0
    for i, (nbytes, ready) in enumerate(grads):
        n, size = n + 1, size + nbytes
        if size > cap_bytes or i == len(grads) - 1:  # the bucket is full, or backward is done: close it
            start = max(ready, free)  # its last gradient is ready, and the all-reduce before it has ended
            free = start + alpha_ms + size / (gbps * 1e6)
            schedule.append((n, start, free))
            n, size = 0, 0
    return schedule
