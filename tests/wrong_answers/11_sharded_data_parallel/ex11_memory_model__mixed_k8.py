    # WRONG (mixed precision: 8 bytes of optimizer per parameter, the fp32 master copy forgotten)
    shard = -(-n_params // world)  # ceil(n_params / world)
    param_b, grad_b, opt_b = (2, 2, 8) if mixed_precision else (4, 4, 8)  # Adam: exp_avg and exp_avg_sq in fp32
    stage = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3}[method]
    return {"params": param_b * (shard if stage >= 3 else n_params),
            "grads": grad_b * (shard if stage >= 2 else n_params),
            "optimizer": opt_b * (shard if stage >= 1 else n_params)}
