    # WRONG (ZeRO-2 shards the parameters instead of the gradients)
    shard = -(-n_params // world)  # ceil(n_params / world)
    param_b, grad_b, opt_b = (2, 2, 12) if mixed_precision else (4, 4, 8)
    sharded = {"ddp": (), "zero1": ("optimizer",), "zero2": ("optimizer", "params"),
               "zero3": ("optimizer", "params", "grads")}[method]
    return {"params": param_b * (shard if "params" in sharded else n_params),
            "grads": grad_b * (shard if "grads" in sharded else n_params),
            "optimizer": opt_b * (shard if "optimizer" in sharded else n_params)}
