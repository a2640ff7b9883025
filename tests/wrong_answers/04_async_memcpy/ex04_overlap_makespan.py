    ### BEGIN SOLUTION
    # Wrong: ignores the overlap: two streams take as long as one.
    return n_chunks * (copy_ms + compute_ms)
    ### END SOLUTION
