    # WRONG (ZeRO-1 shards the gradients too: a rank only needs its shard of them)
    shard = -(-n_params // world)  # ceil(n_params / world)
    param_b, grad_b, opt_b = (2, 2, 12) if mixed_precision else (4, 4, 8)
    stage = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3}[method]
    return {"params": param_b * (shard if stage >= 3 else n_params),
            "grads": grad_b * (shard if stage >= 1 else n_params),
            "optimizer": opt_b * (shard if stage >= 1 else n_params)}
