    ### BEGIN SOLUTION
    # Wrong: the ring pays alpha once, as if its 2(n-1) steps were one message.
    if algorithm == "naive":
        return 2 * (n - 1) * (alpha + nbytes / bandwidth)
    if algorithm == "tree":
        return 2 * math.ceil(math.log2(n)) * (alpha + nbytes / bandwidth)
    return alpha + 2 * (n - 1) / n * nbytes / bandwidth
    ### END SOLUTION
