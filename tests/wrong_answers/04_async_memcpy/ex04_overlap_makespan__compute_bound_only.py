    ### BEGIN SOLUTION
    # Wrong: assumes compute always sets the pace (right only when a compute is at least as long as a copy).
    if streams == 1:
        return n_chunks * (copy_ms + compute_ms)
    return copy_ms + n_chunks * compute_ms
    ### END SOLUTION
