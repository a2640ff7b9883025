    ### BEGIN SOLUTION
    # Wrong: nothing ever hangs.
    return []
    ### END SOLUTION
