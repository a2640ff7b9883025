    ### BEGIN SOLUTION
    # Wrong: a GPU even where the worker sees none.
    return f"cuda:{int(env['LOCAL_RANK'])}"
    ### END SOLUTION
