    ### BEGIN SOLUTION
    # Wrong: the global rank: cuda:4 and up on the second node of a 4-GPU-per-node job.
    return f"cuda:{int(env['RANK'])}" if gpus > 0 else "cpu"
    ### END SOLUTION
