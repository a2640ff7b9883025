    ### BEGIN SOLUTION
    # Wrong: GROUP_RANK numbers the nodes, not the workers of a node.
    return f"cuda:{int(env['GROUP_RANK'])}" if gpus > 0 else "cpu"
    ### END SOLUTION
