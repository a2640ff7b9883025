    ### BEGIN SOLUTION
    # Wrong: forgets the fixed cost per copy (the rate is right, a 1 KiB copy comes out far too fast).
    return 0.0, sizes[-1] / (times_ms[-1] / 1e3) / 1e9
    ### END SOLUTION
