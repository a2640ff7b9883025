        # WRONG (whole Adam states for every parameter, in a module-level torch.optim.Adam instead of on the object;
        # torch's own Adam, so that the parameters come out right and only the bytes can give it away)
        global WHOLE_ADAM
        self.world = dist.get_world_size()
        groups = list(params)
        if not groups or not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        self.groups = [[p for p in g["params"] if p.requires_grad] for g in groups]
        WHOLE_ADAM = torch.optim.Adam([{**{k: g.get(k, v) for k, v in defaults.items()}, "params": ps}
                                       for g, ps in zip(groups, self.groups) if ps])
        ### NEXT SOLUTION
        for params in self.groups:
            for p in params:
                p.grad = None
        ### NEXT SOLUTION
        for params in self.groups:
            if not params:
                continue
            n = sum(p.numel() for p in params)
            shard = -(-n // self.world)
            flat = torch.zeros(self.world * shard)
            flat[:n] = torch.cat([p.grad.reshape(-1) for p in params])
            mine = torch.empty(shard)
            reduce_scatter_tensor(mine, flat)
            all_gather_into_tensor(flat, mine / self.world)  # the averaged gradient, whole, on every rank
            offset = 0
            for p in params:
                p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
                offset += p.numel()
        WHOLE_ADAM.step()
