    ### BEGIN SOLUTION
    # Wrong: the naive all-reduce stops once rank 0 has the sum (a reduce, not an all-reduce).
    if algorithm == "naive":
        return (n - 1) * (alpha + nbytes / bandwidth)
    if algorithm == "tree":
        return 2 * math.ceil(math.log2(n)) * (alpha + nbytes / bandwidth)
    return 2 * (n - 1) * (alpha + nbytes / (n * bandwidth))
    ### END SOLUTION
