    ### BEGIN SOLUTION
    # Wrong: a plausible number, measured nowhere.
    return 0.002
    ### END SOLUTION
