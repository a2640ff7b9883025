    ### BEGIN SOLUTION
    # Wrong: the all-reduce factor for every collective.
    n = world_size
    return max(input_bytes, output_bytes) / seconds / 1e9 * 2 * (n - 1) / n
    ### END SOLUTION
