    # Wrong: the time of `end`, as if `start` were reached at time 0.
    return max(b0_ms + b1_ms, a_ms) + b2_ms
