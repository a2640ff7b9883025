    ### BEGIN SOLUTION
    # Wrong: GiB/s (2**30 bytes) instead of nccl-tests' GB/s (1e9 bytes).
    n = world_size
    factor = 2 * (n - 1) / n if op == "all_reduce" else 1.0 if op in ("broadcast", "reduce") else (n - 1) / n
    return max(input_bytes, output_bytes) / seconds / 2**30 * factor
    ### END SOLUTION
