        # WRONG (shard = n // world and no padding: the values past world * shard are never stepped)
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        groups = list(params)
        if not groups or not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        self.groups, shard_groups = [], []
        for g in groups:
            params = [p for p in g["params"] if p.requires_grad]
            if not params:
                continue
            n = sum(p.numel() for p in params)
            shard = n // self.world  # every rank the same number of values
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            piece = nn.Parameter(flat[self.rank * shard:(self.rank + 1) * shard].clone())
            self.groups.append((params, n, shard, piece))
            shard_groups.append({"params": [piece], **{k: g.get(k, v) for k, v in defaults.items()}})
        self.adam = torch.optim.Adam(shard_groups)
        ### NEXT SOLUTION
        for params, _, _, _ in self.groups:
            for p in params:
                p.grad = None
        ### NEXT SOLUTION
        for params, n, shard, piece in self.groups:
            grads = torch.cat([p.grad.reshape(-1) for p in params])
            mine = torch.empty(shard)
            reduce_scatter_tensor(mine, grads[:self.world * shard])
            piece.grad = mine / self.world
        self.adam.step()
        with torch.no_grad():
            for params, n, shard, piece in self.groups:
                whole = torch.empty(self.world * shard)
                all_gather_into_tensor(whole, piece.detach())
                flat = torch.cat([p.detach().reshape(-1) for p in params])
                flat[:self.world * shard] = whole
                offset = 0
                for p in params:
                    p.copy_(flat[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()
