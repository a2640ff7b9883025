    # WRONG (n_params / world: a float share, not a whole number of values per rank)
    shard = n_params / world  # each rank's part
    param_b, grad_b, opt_b = (2, 2, 12) if mixed_precision else (4, 4, 8)
    stage = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3}[method]
    return {"params": param_b * (shard if stage >= 3 else n_params),
            "grads": grad_b * (shard if stage >= 2 else n_params),
            "optimizer": opt_b * (shard if stage >= 1 else n_params)}
