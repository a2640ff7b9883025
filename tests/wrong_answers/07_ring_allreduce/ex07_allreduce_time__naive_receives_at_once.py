    ### BEGIN SOLUTION
    # Wrong: rank 0 is taken to receive its n-1 tensors all at once, as if its link carried them side by side.
    if algorithm == "naive":
        return 2 * (alpha + nbytes / bandwidth)
    if algorithm == "tree":
        return 2 * math.ceil(math.log2(n)) * (alpha + nbytes / bandwidth)
    return 2 * (n - 1) * (alpha + nbytes / (n * bandwidth))
    ### END SOLUTION
