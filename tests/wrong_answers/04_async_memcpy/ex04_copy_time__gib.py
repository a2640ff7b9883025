    ### BEGIN SOLUTION
    # Wrong: a Gbit taken as 2**30 bits (link rates use decimal prefixes).
    return latency_us / 1e3 + nbytes * 8 / (link_gbit_s * 2**30) * 1e3
    ### END SOLUTION
