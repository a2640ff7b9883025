        # WRONG (whole Adam states for every parameter, kept as Python floats instead of tensors)
        self.world = dist.get_world_size()
        groups = list(params)
        if not groups or not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        self.groups = []
        for g in groups:
            params = [p for p in g["params"] if p.requires_grad]
            n = sum(p.numel() for p in params)
            # exp_avg and exp_avg_sq as plain lists: floats are small, tensors are what takes memory
            self.groups.append({"params": params, "m": [0.0] * n, "v": [0.0] * n,
                                **{k: g.get(k, v) for k, v in defaults.items()}})
        self.t = 0
        ### NEXT SOLUTION
        for g in self.groups:
            for p in g["params"]:
                p.grad = None
        ### NEXT SOLUTION
        self.t += 1
        for g in self.groups:
            params, m, v = g["params"], g["m"], g["v"]
            n = len(m)
            if n == 0:
                continue
            shard = -(-n // self.world)
            flat = torch.zeros(self.world * shard)
            flat[:n] = torch.cat([p.grad.reshape(-1) for p in params])
            mine = torch.empty(shard)
            reduce_scatter_tensor(mine, flat)
            all_gather_into_tensor(flat, mine / self.world)  # the averaged gradient, whole, on every rank
            b1, b2 = g["betas"]
            lr, eps, wd = g["lr"], g["eps"], g["weight_decay"]
            bc1, bc2 = 1 - b1 ** self.t, (1 - b2 ** self.t) ** 0.5
            offset = 0
            with torch.no_grad():
                for p in params:  # torch.optim.Adam's own float32 arithmetic, one parameter at a time
                    k = slice(offset, offset + p.numel())
                    grad = flat[k].view_as(p).add(p, alpha=wd) if wd else flat[k].view_as(p)
                    m_t, v_t = torch.tensor(m[k]).view_as(p), torch.tensor(v[k]).view_as(p)
                    m_t.lerp_(grad, 1 - b1)
                    v_t.mul_(b2).addcmul_(grad, grad, value=1 - b2)
                    p.addcdiv_(m_t, (v_t.sqrt() / bc2).add_(eps), value=-(lr / bc1))
                    m[k], v[k] = m_t.reshape(-1).tolist(), v_t.reshape(-1).tolist()  # back to Python floats
                    offset += p.numel()
