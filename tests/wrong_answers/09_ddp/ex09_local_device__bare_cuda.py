    ### BEGIN SOLUTION
    # Wrong: "cuda" is the current device, cuda:0 unless set: every worker of a node on the same GPU.
    return "cuda" if gpus > 0 else "cpu"
    ### END SOLUTION
