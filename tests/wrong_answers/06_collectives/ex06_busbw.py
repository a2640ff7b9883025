    ### BEGIN SOLUTION
    # Wrong: the shard as S (the smaller tensor), the right factors otherwise.
    n = world_size
    size = min(input_bytes, output_bytes)
    factor = 2 * (n - 1) / n if op == "all_reduce" else 1.0 if op in ("broadcast", "reduce") else (n - 1) / n
    return size / seconds / 1e9 * factor
    ### END SOLUTION
