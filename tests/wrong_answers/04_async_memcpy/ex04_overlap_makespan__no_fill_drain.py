    ### BEGIN SOLUTION
    # Wrong: on two streams, only the slower stage counts: forgets the first copy and the last compute.
    if streams == 1:
        return n_chunks * (copy_ms + compute_ms)
    return n_chunks * max(copy_ms, compute_ms)
    ### END SOLUTION
