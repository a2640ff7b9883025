    ### BEGIN SOLUTION
    # Wrong: (n-1)/n for broadcast and reduce too, as if the root kept a share.
    n = world_size
    factor = 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n
    return max(input_bytes, output_bytes) / seconds / 1e9 * factor
    ### END SOLUTION
