    ### BEGIN SOLUTION
    # Wrong: takes the link's Gbit/s for GB/s (bits counted as bytes): 8x too fast.
    return latency_us / 1e3 + nbytes / (link_gbit_s * 1e9) * 1e3
    ### END SOLUTION
