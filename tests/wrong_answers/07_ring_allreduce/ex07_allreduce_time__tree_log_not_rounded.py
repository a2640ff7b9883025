    ### BEGIN SOLUTION
    # Wrong: a tree over 5 ranks has 3 levels, not log2(5) = 2.32.
    if algorithm == "naive":
        return 2 * (n - 1) * (alpha + nbytes / bandwidth)
    if algorithm == "tree":
        return 2 * math.log2(n) * (alpha + nbytes / bandwidth)
    return 2 * (n - 1) * (alpha + nbytes / (n * bandwidth))
    ### END SOLUTION
