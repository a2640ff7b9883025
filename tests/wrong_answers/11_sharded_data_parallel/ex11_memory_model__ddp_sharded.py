    # WRONG (DDP splits everything over the ranks, like ZeRO-3)
    shard = -(-n_params // world)  # ceil(n_params / world)
    param_b, grad_b, opt_b = (2, 2, 12) if mixed_precision else (4, 4, 8)
    stage = {"ddp": 3, "zero1": 1, "zero2": 2, "zero3": 3}[method]  # data parallel: each rank its 1/world
    return {"params": param_b * (shard if stage >= 3 else n_params),
            "grads": grad_b * (shard if stage >= 2 else n_params),
            "optimizer": opt_b * (shard if stage >= 1 else n_params)}
