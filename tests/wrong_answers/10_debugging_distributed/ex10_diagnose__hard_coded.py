    ### BEGIN SOLUTION
    # Wrong: one diagnosis, memorised from a run seen before.
    return 1, "stall", 9
    ### END SOLUTION
