    ### BEGIN SOLUTION
    # Wrong: the global rank modulo the GPU count: right only when every node runs one worker per GPU.
    return f"cuda:{int(env['RANK']) % gpus}" if gpus > 0 else "cpu"
    ### END SOLUTION
