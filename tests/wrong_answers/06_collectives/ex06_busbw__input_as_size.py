    ### BEGIN SOLUTION
    # Wrong: S is always the input tensor (the shard for all_gather and gather).
    n = world_size
    factor = 2 * (n - 1) / n if op == "all_reduce" else 1.0 if op in ("broadcast", "reduce") else (n - 1) / n
    return input_bytes / seconds / 1e9 * factor
    ### END SOLUTION
