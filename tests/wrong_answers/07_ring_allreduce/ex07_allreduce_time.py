    ### BEGIN SOLUTION
    # Wrong: the ring's steps each move the whole tensor, not one chunk of it.
    if algorithm == "naive":
        steps = 2 * (n - 1)
    elif algorithm == "tree":
        steps = 2 * math.ceil(math.log2(n))
    else:
        steps = 2 * (n - 1)
    return steps * (alpha + nbytes / bandwidth)
    ### END SOLUTION
