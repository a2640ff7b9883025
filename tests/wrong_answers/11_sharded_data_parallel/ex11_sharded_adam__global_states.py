        # WRONG (whole Adam states for every parameter, kept in a module-level dict instead of on the object)
        global ADAM_STATES
        ADAM_STATES = {}  # parameter -> (exp_avg, exp_avg_sq): not the optimizer's, so not counted as its memory
        self.world = dist.get_world_size()
        groups = list(params)
        if not groups or not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        self.groups = [({k: g.get(k, v) for k, v in defaults.items()}, [p for p in g["params"] if p.requires_grad])
                       for g in groups]
        self.t = 0
        ### NEXT SOLUTION
        for _, params in self.groups:
            for p in params:
                p.grad = None
        ### NEXT SOLUTION
        self.t += 1
        for settings, params in self.groups:
            if not params:
                continue
            n = sum(p.numel() for p in params)
            shard = -(-n // self.world)
            flat = torch.zeros(self.world * shard)
            flat[:n] = torch.cat([p.grad.reshape(-1) for p in params])
            mine = torch.empty(shard)
            reduce_scatter_tensor(mine, flat)
            all_gather_into_tensor(flat, mine / self.world)  # the averaged gradient, whole, on every rank
            b1, b2 = settings["betas"]
            bc1, bc2 = 1 - b1 ** self.t, (1 - b2 ** self.t) ** 0.5
            offset = 0
            with torch.no_grad():
                for p in params:
                    grad = flat[offset:offset + p.numel()].view_as(p) + settings["weight_decay"] * p
                    offset += p.numel()
                    if p not in ADAM_STATES:
                        ADAM_STATES[p] = (torch.zeros_like(p), torch.zeros_like(p))
                    m, v = ADAM_STATES[p]
                    m.mul_(b1).add_(grad, alpha=1 - b1)
                    v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
                    p.addcdiv_(m, v.sqrt().div_(bc2).add_(settings["eps"]), value=-settings["lr"] / bc1)
