    ### BEGIN SOLUTION
    # Wrong: the right time, in seconds.
    return latency_us / 1e6 + nbytes * 8 / (link_gbit_s * 1e9)
    ### END SOLUTION
