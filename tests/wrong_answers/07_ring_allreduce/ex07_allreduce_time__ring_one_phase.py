    ### BEGIN SOLUTION
    # Wrong: the ring's all-gather is forgotten (n-1 steps, the reduce-scatter only).
    if algorithm == "naive":
        return 2 * (n - 1) * (alpha + nbytes / bandwidth)
    if algorithm == "tree":
        return 2 * math.ceil(math.log2(n)) * (alpha + nbytes / bandwidth)
    return (n - 1) * (alpha + nbytes / (n * bandwidth))
    ### END SOLUTION
